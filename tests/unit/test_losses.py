"""compute_average_loss / scale_regularization_loss: which batch size they divide by, where."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from towers import compute_average_loss, scale_regularization_loss
from towers.cluster.info import ProcessInfo
from towers.strategies import base
from towers.strategies.base import ReplicaContext
from towers.strategies.one_device import OneDeviceStrategy


def _in_context(fn, **context):
    replicas = context.pop("replicas", 1)
    ctx = ReplicaContext(SimpleNamespace(replica_id=0, num_replicas_in_sync=replicas), **context)
    token = base._current_replica.set(ctx)
    try:
        return fn()
    finally:
        base._current_replica.reset(token)


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
    token = base._current_strategy.set(SimpleNamespace(num_replicas_in_sync=2))
    try:
        with pytest.raises(ValueError, match="outside strategy.run while 2 replicas train in sync"):
            compute_average_loss(torch.ones(3))
        assert compute_average_loss(torch.ones(3), 6).item() == pytest.approx(0.5)
    finally:
        base._current_strategy.reset(token)


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
