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


def _out_of_step() -> dict:
    """A rank-dependent loop over ``distribute_dataset``: rank 1 runs a batch twice, then (fresh model) skips one."""
    strategy = towers.MirroredStrategy(timeout_s=30)
    rank = strategy.replica_id
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))

    def train(runs_of) -> dict:  # runs_of(rank, epoch, i): how often this rank runs batch i of the epoch
        with strategy.scope():
            torch.manual_seed(0)
            net = nn.Linear(4, 2)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net, opt = strategy.prepare(net, opt)

        def step(x, y):
            towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none")).backward()
            opt.step()
            opt.zero_grad()

        batches = strategy.distribute_dataset(data, 16, shuffle=False)  # 4 global batches per epoch
        out: dict = {"ran": []}
        for epoch in range(3):
            for i, batch in enumerate(batches):
                for _ in range(runs_of(rank, epoch, i)):
                    started = time.monotonic()
                    try:
                        strategy.run(step, args=batch)
                    except Exception as exc:  # noqa: BLE001 - returned so the parent asserts on it
                        out.update(error=f"{type(exc).__name__}: {exc}", at=(epoch, i),
                                   waited_s=time.monotonic() - started)
                        return out
                    out["ran"].append((epoch, i))
            if epoch == 0:
                out["params_after_epoch_0"] = [p.detach().clone() for p in net.parameters()]
        return out

    twice = train(lambda r, epoch, i: 2 if (r, epoch, i) == (1, 1, 0) else 1)
    skipped = train(lambda r, epoch, i: 0 if (r, epoch, i) == (1, 0, 2) else 1)
    return {"rank": rank, "twice": twice, "skipped": skipped}


def _plain_epoch(data: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """One epoch of the same loop on one device in plain torch: 4 batches of 16, mean loss, SGD."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = data
    for i in range(0, 64, 16):
        F.cross_entropy(net(x[i:i + 16]), y[i:i + 16]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net.parameters()]


def test_a_replica_out_of_step_over_distribute_dataset_is_named_at_that_step_on_every_rank():
    try:
        results = towers.spawn(_out_of_step, 2, timeout_s=60)
    except SpawnError as exc:  # a hang or a Gloo abort instead of the named error
        pytest.fail(f"a rank failed instead of reporting: {exc}")
    g = torch.Generator().manual_seed(0)
    plain = _plain_epoch((torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)))
    for r in results:  # the aligned epoch 0 is one device's maths, unchanged by the identity it carries
        for got, want in zip(r["twice"]["params_after_epoch_0"], plain):
            assert torch.allclose(got, want, atol=1e-6), (got, want)
    steps = "The replicas are out of step: this rank's gradient sync is for"
    # rank 1 runs epoch 1's batch 0 a second time while rank 0 runs batch 1: both stop in that step
    chief, other = results[0]["twice"], results[1]["twice"]
    assert chief["at"] == (1, 1) and other["at"] == (1, 0), (chief, other)
    assert other["ran"][-1] == (1, 0) and chief["ran"][-1] == (1, 0)  # the first run of batch 0 was in step
    assert chief["error"].startswith("MismatchedStepsError: [rank 0/2] "), chief["error"]
    assert f"{steps} epoch 1, global batch 1, but rank 1 ran epoch 1, global batch 0." in chief["error"]
    assert f"{steps} epoch 1, global batch 0, but rank 0 ran epoch 1, global batch 1." in other["error"]
    assert "same batches of strategy.distribute_dataset in the same order" in other["error"]
    # rank 1 skips epoch 0's batch 2: its batch 3 meets rank 0's batch 2
    chief, other = results[0]["skipped"], results[1]["skipped"]
    assert chief["at"] == (0, 2) and other["at"] == (0, 3), (chief, other)
    assert f"{steps} epoch 0, global batch 2, but rank 1 ran epoch 0, global batch 3." in chief["error"]
    assert f"{steps} epoch 0, global batch 3, but rank 0 ran epoch 0, global batch 2." in other["error"]
    for r in results:  # at once, well within the strategy's timeout_s (30 s): no wait on a peer
        assert r["twice"]["waited_s"] < 10 and r["skipped"]["waited_s"] < 10, r
