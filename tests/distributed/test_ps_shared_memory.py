"""Parameter servers on one host: the dense push and pull through shared memory, the same maths as the wire.

2 workers + 1 ps task, sync mode, the same steps in two jobs: one where worker 1 shares memory with
the ps task and worker 0 keeps the wire (its own ``shared_memory=False``), and one where the ps task
refuses both workers' offers (its ``shared_memory=False``: what a ps on another host does). The
parameters are bitwise the same; the bytes went where each process said; no file is left in /dev/shm.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.strategies.parameter_server.shared import SHARED_DIR

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.isdir(SHARED_DIR), reason="no /dev/shm on this host")]

STEPS = 4


def _job(setup: str) -> dict | None:
    rank = int(os.environ["RANK"])
    is_ps = rank == int(os.environ["WORLD_SIZE"]) - 1  # the ps tasks are the last ranks
    shared = rank != 0 if setup == "mixed" else not is_ps  # "refused": the workers offer, the ps says no
    strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False, shared_memory=shared)
    if strategy.is_ps:
        return None
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 3))
    model, optimizer = strategy.prepare(net, torch.optim.Adam(net.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1 + strategy.replica_id)
    before = strategy.wire_stats()  # the chief's registration sends the starting values on the wire
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"), global_batch_size=16).backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"params": [p.detach().clone() for p in strategy.unwrap(model).parameters()],
           "wire": {k: v - before[k] for k, v in strategy.wire_stats().items()}, "pid": os.getpid(),
           "nbytes": sum(p.numel() * p.element_size() for p in net.parameters())}
    strategy.shutdown()
    return out


def test_shared_memory_moves_the_dense_bytes_with_the_same_maths():
    runs = {setup: towers.spawn(_job, 3, args=(setup,), timeout_s=120,
                                env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})[:2]
            for setup in ("mixed", "refused")}
    reference = runs["refused"][0]["params"]
    for setup, workers in runs.items():
        for w, got in enumerate(workers):
            assert all(torch.equal(a, b) for a, b in zip(got["params"], reference)), (setup, w)
    nbytes = runs["refused"][0]["nbytes"]
    sharing = runs["mixed"][1]
    # every push's gradients and every reply's parameters, not a byte of them on the wire
    assert sharing["wire"]["shared_memory_bytes"] >= 2 * STEPS * nbytes
    assert sharing["wire"]["bytes_sent"] < nbytes and sharing["wire"]["bytes_received"] < 2 * nbytes
    for name, got in (("worker 0 said no", runs["mixed"][0]), ("refused 0", runs["refused"][0]),
                      ("refused 1", runs["refused"][1])):
        assert got["wire"]["shared_memory_bytes"] == 0, name
        assert got["wire"]["bytes_sent"] >= STEPS * nbytes, name
    left = [name for name in os.listdir(SHARED_DIR)
            if any(name.startswith(f"towers-ps-{got['pid']}-") for workers in runs.values() for got in workers)]
    assert left == []
