"""compute_average_loss / scale_regularization_loss: which batch size they divide by, where."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from towers import compute_average_loss, scale_regularization_loss
from towers.cluster.info import ProcessInfo
from towers.strategies import base
from towers.strategies.base import ReplicaContext
from towers.strategies.context import CURRENT_REPLICA, CURRENT_STRATEGY
from towers.strategies.one_device import OneDeviceStrategy


def _in_context(fn, **context):
    replicas = context.pop("replicas", 1)
    ctx = ReplicaContext(SimpleNamespace(replica_id=0, num_replicas_in_sync=replicas), **context)
    token = CURRENT_REPLICA.set(ctx)
    try:
        return fn()
    finally:
        CURRENT_REPLICA.reset(token)


def test_outside_a_strategy_it_is_the_local_mean():
    losses = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert compute_average_loss(losses).item() == pytest.approx(3.0)
    assert compute_average_loss(losses, 8).item() == pytest.approx(1.5)
    assert compute_average_loss(torch.zeros(0)).item() == 0.0


def test_inside_a_run_it_divides_by_the_global_batch_from_distribute_dataset():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo())
    strategy.prepare(torch.nn.Linear(1, 1))
    batches = strategy.distribute_dataset(torch.ones(10), 4, shuffle=False)
    got = [strategy.run(compute_average_loss, args=(b,)).item() for b in batches]
    assert got == pytest.approx([1.0, 1.0, 1.0])  # the last batch (2 examples) divides by 2
    seen = [strategy.run(lambda _: base.current_replica_context().global_batch_size, args=(b,)) for b in batches]
    assert seen == [4, 4, 2]


def test_under_accumulation_it_divides_by_the_examples_of_the_update():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    strategy.prepare(torch.nn.Linear(1, 1))
    batches = strategy.distribute_dataset(torch.ones(10), 4, shuffle=False)
    got = [strategy.run(compute_average_loss, args=(b,)).item() for b in batches]
    assert got == pytest.approx([0.5, 0.5, 1.0])  # updates of 8 and 2 examples


def test_without_batch_knowledge_several_replicas_or_micro_batches_need_the_global_batch_size():
    for context in ({"replicas": 2}, {"accumulation_steps": 2}):
        with pytest.raises(ValueError, match="not given a batch from strategy.distribute_dataset.*global_batch_size=N"):
            _in_context(lambda: compute_average_loss(torch.ones(3)), **context)
    explicit = _in_context(lambda: compute_average_loss(torch.ones(3), 12), replicas=2, accumulation_steps=2)
    assert explicit.item() == pytest.approx(3 / 12)
    loss = _in_context(lambda: compute_average_loss(torch.ones(3)), replicas=2, global_batch_size=5)
    assert loss.item() == pytest.approx(3 / 5)
    assert _in_context(lambda: compute_average_loss(torch.ones(3))).item() == pytest.approx(1.0)  # one replica


def test_outside_run_with_several_replicas_in_sync_it_refuses_to_guess():
    token = CURRENT_STRATEGY.set(SimpleNamespace(num_replicas_in_sync=2))
    try:
        with pytest.raises(ValueError, match="outside strategy.run while 2 replicas train in sync"):
            compute_average_loss(torch.ones(3))
        assert compute_average_loss(torch.ones(3), 6).item() == pytest.approx(0.5)
    finally:
        CURRENT_STRATEGY.reset(token)


def test_a_kept_batch_a_prefetched_batch_and_an_eval_pass_in_between_keep_their_own_divisor():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    strategy.prepare(torch.nn.Linear(1, 1))
    train = iter(strategy.distribute_dataset(torch.ones(10), 4, shuffle=False))
    first, second = next(train), next(train)  # the next batch fetched before the first runs
    for _ in strategy.distribute_dataset(torch.ones(3), 3):  # another dataset's batch in between
        pass
    divisor = lambda b: strategy.run(lambda x: base.current_replica_context().global_batch_size, args=(b,))  # noqa: E731
    assert [divisor(first), divisor(second), divisor(first), divisor(next(train))] == [8, 8, 8, 2]


def test_padding_examples_weigh_zero_and_sample_weights_apply():
    per_example = torch.tensor([2.0, 100.0], requires_grad=True)
    loss = _in_context(lambda: compute_average_loss(per_example), global_batch_size=4, num_padding_examples=1)
    loss.backward()
    assert loss.item() == pytest.approx(0.5) and per_example.grad.tolist() == [0.25, 0.0]
    weighted = compute_average_loss(torch.tensor([1.0, 3.0]), sample_weight=torch.tensor([1.0, 0.0]))
    assert weighted.item() == pytest.approx(0.5)


def test_regularization_is_divided_by_replicas_and_micro_batches():
    assert scale_regularization_loss(6.0) == 6.0
    assert _in_context(lambda: scale_regularization_loss(torch.tensor(6.0)), replicas=3).item() == pytest.approx(2.0)
    assert _in_context(lambda: scale_regularization_loss(6.0), replicas=3, accumulation_steps=2) == pytest.approx(1.0)


def test_bad_inputs_are_explained():
    with pytest.raises(ValueError, match="one loss per example.*reduction='none'"):
        compute_average_loss(torch.tensor(1.0))
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer. Received: 0"):
        compute_average_loss(torch.ones(2), 0)


def _token_model_and_data():
    torch.manual_seed(0)
    x = torch.randn(8, 5, 3)  # 8 sequences of 5 tokens
    y = torch.randn(8, 5)
    weights = (torch.rand(8, 5) > 0.4).float()
    weights[:4, 3:] = 0  # the first micro-batch holds fewer tokens than the second
    return x, y, weights


def _weighted_update(accumulation: int, *, clip: float | None = None) -> torch.Tensor:
    """One update on (x, y, weights) under OneDeviceStrategy with accumulation; the parameters after it."""
    x, y, weights = _token_model_and_data()
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=accumulation)
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 1)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))

    def step(xb, yb, wb):
        per_token = (model(xb).squeeze(-1) - yb) ** 2
        loss = compute_average_loss(per_token, weights=wb)
        loss.backward()
        if clip is not None:
            strategy.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for batch in strategy.distribute_dataset((x, y, weights), 8 // accumulation, shuffle=False):
        strategy.run(step, args=batch)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_weights_normalise_by_the_updates_total_weight_across_micro_batches():
    one = _weighted_update(1)
    x, y, weights = _token_model_and_data()
    torch.manual_seed(1)
    reference = torch.nn.Linear(3, 1)
    ((((reference(x).squeeze(-1) - y) ** 2) * weights).sum() / weights.sum()).backward()
    expected = torch.cat([(p - p.grad).detach().flatten() for p in reference.parameters()])
    assert torch.allclose(one, expected, atol=1e-6)  # one device: the token mean
    assert torch.allclose(_weighted_update(2), one, atol=1e-6)  # two micro-batches of unequal token counts
    assert torch.allclose(_weighted_update(2, clip=0.05), _weighted_update(1, clip=0.05), atol=1e-6)  # clipped after


def _prepared(strategy, model):
    return strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_value_of_a_weighted_loss_is_the_shares_mean_over_the_shares():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    _prepared(strategy, torch.nn.Linear(1, 1))
    per_token, weights = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True), torch.tensor([[1.0, 1.0, 0.0]])
    batches = list(strategy.distribute_dataset((per_token.detach().repeat(2, 1), weights.repeat(2, 1)), 1, shuffle=False))
    loss = strategy.run(lambda *_: compute_average_loss(per_token, weights=weights), args=batches[0])
    assert loss.item() == pytest.approx(2.0 / 2)  # mean over its 2 tokens, one of 2 shares
    loss.backward()
    assert per_token.grad.tolist() == [[1.0, 1.0, 0.0]]  # the weighted SUM's gradient, divided at the update step


def test_a_weighted_and_an_example_normalised_loss_cannot_share_an_update():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    model, _ = _prepared(strategy, torch.nn.Linear(2, 1))
    data = torch.ones(4, 2)
    batch = next(iter(strategy.distribute_dataset(data, 2, shuffle=False)))

    def mixed(xb):
        out = model(xb).squeeze(-1)
        compute_average_loss(out, weights=torch.ones(len(out)))
        compute_average_loss(out)

    with pytest.raises(ValueError, match="cannot share an update.*Received: an example-normalised loss after a weighted"):
        strategy.run(mixed, args=(batch,))


def test_an_evaluation_pass_leaves_nothing_behind_for_the_next_update():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    model, _ = _prepared(strategy, torch.nn.Linear(2, 1))
    batches = list(strategy.distribute_dataset(torch.ones(4, 2), 2, shuffle=False))
    with torch.no_grad():  # a validation loss under no_grad notes nothing
        strategy.run(lambda xb: compute_average_loss(model(xb).squeeze(-1), weights=torch.ones(len(xb))), args=(batches[0],))
    assert not strategy._loss_weights.weighted
    for b in batches:  # with gradients on but no optimizer step: the next update starts afresh
        strategy.run(lambda xb: compute_average_loss(model(xb).squeeze(-1), weights=torch.ones(len(xb))), args=(b,))
    strategy.run(lambda xb: compute_average_loss(model(xb).squeeze(-1)), args=(batches[0],))  # plain: no error
    assert strategy._loss_weights.plain and not strategy._loss_weights.weighted


def test_bad_weights_are_explained():
    losses = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"weights must have the loss's shape.*Received: loss \(4, 3\), weights \(4, 2\)"):
        compute_average_loss(losses, weights=torch.ones(4, 2))
    with pytest.raises(ValueError, match="takes weights= alone.*Received: weights with global_batch_size"):
        compute_average_loss(losses, 8, weights=torch.ones(4, 3))
    with pytest.raises(ValueError, match="expects two tensors.*Received: Tensor and list"):
        compute_average_loss(losses, weights=[1, 2, 3])  # type: ignore[arg-type]
    assert compute_average_loss(losses * 2, weights=torch.ones(3)).item() == pytest.approx(2.0)  # broadcast
    assert compute_average_loss(losses, weights=torch.zeros(4, 3)).item() == 0.0  # nothing weighs: 0, not NaN


@pytest.mark.parametrize("bad,count", [(float("nan"), 12), (-1.0, 12), ([1.0, float("inf"), -2.0], 8)],
                         ids=["nan", "negative", "inf-and-negative-in-a-tensor"])
def test_a_non_finite_or_negative_weight_is_refused_with_the_count_and_the_fix(bad, count):
    # Plain torch would train on it: the weighted sum over the sum of weights is NaN, or a loss pushed up.
    losses = torch.ones(4, 3, requires_grad=True)
    weights = torch.tensor(bad).expand(4, 3) if isinstance(bad, float) else torch.tensor([bad] * 4)
    assert not torch.isfinite((losses * weights).sum() / weights.sum()) or (weights < 0).any()
    with pytest.raises(ValueError, match=rf"finite weights >= 0.*Received: {count} of 12 weight\(s\) NaN, infinite or "
                                         r"negative.*\(labels != -100\).float\(\).*nan_to_num"):
        compute_average_loss(losses, weights=weights)
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)  # the noted path too
    _prepared(strategy, torch.nn.Linear(1, 1))
    batch = next(iter(strategy.distribute_dataset(torch.ones(4, 1), 2, shuffle=False)))
    with pytest.raises(ValueError, match=rf"Received: {count} of 12 weight"):
        strategy.run(lambda _: compute_average_loss(losses, weights=weights), args=(batch,))
    assert strategy._loss_weights.weight == 0.0  # nothing was noted


def test_weights_are_counted_exactly_whatever_the_losss_dtype():
    losses = torch.ones(1, 301, dtype=torch.bfloat16)  # a bf16 sum of 301 ones is not 301
    value = compute_average_loss(losses, weights=torch.ones(1, 301, dtype=torch.bfloat16))
    assert value.item() == pytest.approx(1.0, abs=1e-2)
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    _prepared(strategy, torch.nn.Linear(1, 1))
    batch = next(iter(strategy.distribute_dataset(torch.ones(4, 1), 2, shuffle=False)))
    loss = torch.ones(1, 301, dtype=torch.bfloat16, requires_grad=True)
    strategy.run(lambda _: compute_average_loss(loss, weights=torch.ones(1, 301, dtype=torch.bfloat16)), args=(batch,))
    assert strategy._loss_weights.weight == 301.0


def test_a_weighted_loss_needs_the_prepared_optimizer_that_divides_it():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=2)
    model, _ = strategy.prepare(torch.nn.Linear(2, 1))  # no optimizer: nothing would divide the gradient
    batch = next(iter(strategy.distribute_dataset(torch.ones(4, 2), 2, shuffle=False)))
    with pytest.raises(ValueError, match="prepared no optimizer.*model, optimizer = strategy.prepare"):
        strategy.run(lambda xb: compute_average_loss(model(xb).squeeze(-1), weights=torch.ones(len(xb))), args=(batch,))
