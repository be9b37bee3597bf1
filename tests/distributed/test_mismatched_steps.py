"""Replicas whose own loaders yield different numbers of batches get one clear error, not a silent wrong pairing."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.launch.spawn import SpawnError

pytestmark = pytest.mark.timeout(120)


def _uneven(batches_per_rank: tuple[int, ...]) -> dict:
    strategy = towers.MirroredStrategy()
    rank = strategy.replica_id
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = strategy.prepare(net, opt)

    def step(x, y):  # a user's own loader: the global batch is this replica's rows times the replicas
        loss = towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"),
                                           global_batch_size=len(x) * strategy.num_replicas_in_sync)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    g = torch.Generator().manual_seed(rank)
    aligned = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(3)]
    # a plain list per replica, the same length on both: per-step reduce and an epoch-end barrier work as before
    losses = [strategy.reduce("mean", strategy.run(step, args=batch)).item() for batch in aligned]
    strategy.barrier()
    # then a user's uneven split: rank r has batches_per_rank[r] batches; the epoch ends with a reduce
    uneven = aligned[:1] * batches_per_rank[rank]
    try:
        total = torch.zeros(())
        for batch in uneven:
            total += strategy.run(step, args=batch)
        final = strategy.reduce("sum", total).item()
    except Exception as exc:  # noqa: BLE001 - returned so the parent asserts on it
        return {"rank": rank, "aligned_losses": losses, "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": rank, "aligned_losses": losses, "final": final}


@pytest.mark.parametrize("counts, short", [((2, 3), 0), ((3, 2), 1)])
def test_a_replica_with_fewer_batches_is_named_with_both_counts_at_the_epoch_end_reduce(counts, short):
    try:
        results = towers.spawn(_uneven, 2, args=(counts,), timeout_s=60)
    except SpawnError as exc:  # a rank that failed outside the try block: the message shows each rank's state
        pytest.fail(f"a rank failed instead of reporting: {exc}")
    assert [r["rank"] for r in results] == [0, 1]
    assert all(len(r["aligned_losses"]) == 3 for r in results)  # equal plain lists: no false alarm
    assert not [r for r in results if "final" in r], f"a rank finished with a wrongly paired result: {results}"
    error = results[short]["error"]
    assert error.startswith("MismatchedStepsError: "), results
    # 3 aligned steps, then 2 on the short replica and 3 on the other
    assert (f"came after 5 step(s) (strategy.run calls) on rank {short}, while rank {1 - short} was starting "
            "step 6") in error, error
    assert "distribute_dataset" in error, error
    assert "error" in results[1 - short], results[1 - short]  # its extra step cannot complete without the other


def _metric_on_the_chief_only() -> dict:
    """TensorFlow's habit: ``metric.result()`` inside ``if strategy.is_chief:``, between steps of a custom loop."""
    strategy = towers.MirroredStrategy(timeout_s=6)  # the named error comes within half of it
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Linear(4, 3)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        accuracy = towers.metrics.SparseCategoricalAccuracy()
    net, opt = strategy.prepare(net, opt)
    correct = torch.zeros(2)  # plain torch on this replica's own examples: [right, seen]

    def step(x, y):
        logits = net(x)
        strategy.backward(towers.compute_average_loss(F.cross_entropy(logits, y, reduction="none")))
        opt.step()
        opt.zero_grad()
        accuracy.update(logits, y)
        correct.add_(torch.tensor([float((logits.argmax(1) == y).sum()), float(len(y))]))

    g = torch.Generator().manual_seed(0)
    batches = list(strategy.distribute_dataset((torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)), 8))
    out: dict = {"rank": strategy.replica_id}
    for batch in batches[:2]:
        strategy.run(step, args=batch)
    out["every_rank"], out["plain"] = accuracy.result(), correct.clone()  # the collective, as documented
    strategy.run(step, args=batches[2])
    if strategy.is_chief:
        started = time.monotonic()
        try:
            out["chief_only"] = accuracy.result()
        except Exception as exc:  # noqa: BLE001 - returned so the parent asserts on it
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["waited_s"] = time.monotonic() - started
    for batch in batches[3:]:  # both ranks go on: nothing aborted, the gradient all-reduces still pair
        strategy.run(step, args=batch)
    out["params"] = [p.detach().clone() for p in net.parameters()]
    return out


def test_metric_result_on_the_chief_only_names_result_and_the_fix_without_a_gloo_abort():
    try:
        results = towers.spawn(_metric_on_the_chief_only, 2, timeout_s=60)
    except SpawnError as exc:
        pytest.fail(f"a rank failed instead of reporting (a Gloo abort or a hang): {exc}")
    chief, other = results
    plain = chief["plain"] + other["plain"]  # the replicas' own counts, added without towers
    assert chief["every_rank"] == other["every_rank"] == pytest.approx(float(plain[0] / plain[1]))
    assert "chief_only" not in chief, "the chief alone cannot combine the other replica's examples"
    assert chief["error"].startswith("PartialCollectiveError: [rank 0/2] Metric.result() of "
                                     "'sparse_categorical_accuracy'"), chief["error"]
    assert "Call result() on every replica and print on the chief" in chief["error"]
    assert chief["waited_s"] < 6  # half the strategy's timeout_s, before the other rank's own collective gives up
    assert all(torch.equal(a, b) for a, b in zip(chief["params"], other["params"]))
