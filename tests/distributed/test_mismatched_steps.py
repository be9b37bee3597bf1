"""Replicas whose own loaders yield different numbers of batches get one clear error, not a silent wrong pairing."""

from __future__ import annotations

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

    def step(x, y):
        loss = F.cross_entropy(net(x), y)
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
