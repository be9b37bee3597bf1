"""Faults under ParameterServerStrategy (async): a dead worker does not stop the job; a dead ps does.

One job of 1 ps + 2 workers. Worker 1 pushes ``VICTIM_STEPS`` gradients and dies (``os._exit``).
The chief logs it, goes on to ``CHIEF_STEPS`` pushes, and the ps counts exactly the pushes of both
(no update of a survivor lost, none of the dead one invented); collectives then cover the live
worker only. Then the ps dies: the chief's next step raises a ``DistributedError`` naming
"ps task 0 (rank 2)" within seconds.

``towers.spawn`` stops the whole job when one of its ranks dies, so each victim (worker 1, the ps)
runs in a child process of its spawn rank, which just waits for it: the spawn sees a clean rank.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.process_group import DistributedError

pytestmark = pytest.mark.timeout(180)

VICTIM_STEPS = 3
CHIEF_STEPS = 8


def _strategy() -> towers.Strategy:
    return towers.strategy_from_env(mode="async", timeout_s=30, exit_on_ps=False)


def _train_step(net: nn.Module, optimizer: torch.optim.Optimizer, g: torch.Generator) -> None:
    x = torch.randn(8, 4, generator=g)
    F.cross_entropy(net(x), (x[:, 0] > 0).long()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _prepared(strategy: towers.Strategy) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))


def _victim_worker() -> None:
    strategy = _strategy()
    net, optimizer = _prepared(strategy)
    g = torch.Generator().manual_seed(1)
    for _ in range(VICTIM_STEPS):
        _train_step(net, optimizer, g)
    os._exit(1)  # dies without a goodbye, between two steps


def _victim_ps(kill_file: str) -> None:
    def watch() -> None:
        while not os.path.exists(kill_file):
            time.sleep(0.05)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    _strategy()


def _chief(kill_file: str) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("towers").addHandler(handler)
    strategy = _strategy()
    net, optimizer = _prepared(strategy)
    g = torch.Generator().manual_seed(0)
    for _ in range(VICTIM_STEPS):
        _train_step(net, optimizer, g)
    deadline = time.monotonic() + 20
    while not strategy.ps_stats()[0]["dead"] and time.monotonic() < deadline:  # wait until worker 1 is gone
        time.sleep(0.05)
    for _ in range(CHIEF_STEPS - VICTIM_STEPS):
        _train_step(net, optimizer, g)
    result = {"stats": strategy.ps_stats()[0], "logged": [r for r in records if "is gone" in r],
              "reduced": strategy.reduce("sum", torch.tensor(5.0)).item(),
              "gathered": strategy.gather(torch.tensor([7.0])).tolist()}
    strategy.barrier()
    open(kill_file, "w").close()  # now the ps dies
    start = time.monotonic()
    try:
        for _ in range(200):
            _train_step(net, optimizer, g)
            time.sleep(0.02)
        result["error"] = None
    except DistributedError as exc:
        result["error"] = str(exc)
    result["seconds_to_error"] = time.monotonic() - start
    strategy.shutdown()
    return result


def _rank(kill_file: str) -> dict | int | None:
    rank = int(os.environ["RANK"])
    if rank == 0:
        return _chief(kill_file)
    victim = mp.get_context("spawn").Process(target=_victim_worker if rank == 1 else _victim_ps,
                                             args=() if rank == 1 else (kill_file,))
    victim.start()
    victim.join(150)
    return victim.exitcode


def test_dead_worker_does_not_stop_async_training_and_dead_ps_stops_it(tmp_path):
    chief, worker_exit, ps_exit = towers.spawn(_rank, 3, args=(str(tmp_path / "kill-ps"),), timeout_s=150,
                                               env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})
    assert worker_exit == 1 and ps_exit == 1
    stats = chief["stats"]
    assert list(stats["dead"]) == [1]
    # every push of the survivor and of the dead worker (before it died) was applied once
    assert stats["worker_versions"] == [CHIEF_STEPS, VICTIM_STEPS]
    assert stats["version"] == CHIEF_STEPS + VICTIM_STEPS
    assert any("worker 1 (rank 1) is gone" in line for line in chief["logged"]), chief["logged"]
    assert chief["reduced"] == 5.0 and chief["gathered"] == [7.0]  # collectives over the live worker only
    assert chief["error"] is not None and "ps task 0 (rank 2) is gone" in chief["error"], chief["error"]
    assert chief["error"].startswith("[rank 0/3] push failed")
    assert chief["seconds_to_error"] < 10
