"""towers' control-plane traffic per rank does not grow with the job (the simulator of benchmarks/control_plane.py).

Simulated ranks drive the real ``Watchdog.tick`` and ``PreemptionHandler.should_save`` against a
real ``TCPStore`` in virtual job time. What a user has without towers' control plane is no store
traffic at all, so the reference is a fixed per-rank budget, not towers against itself.
"""

from __future__ import annotations

import importlib.util
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from towers.cluster.info import ProcessInfo
from towers.diagnostics.watchdog import Watchdog
from towers.strategies.parameter_server.dispatch import Dispatcher

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "control_plane.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("control_plane_bench", _PATH)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def test_per_rank_store_traffic_stays_flat_from_64_to_256_ranks_and_the_ranks_agree_on_one_step(sim, store):
    rates, saved = {}, {}
    for n in (64, 256):
        res = sim.steady(None, range(n), n, seconds=80.0, step_s=1.0, legacy=False, notice_at_s=60.0, store=store,
                         prefix=f"ci{n}")
        rates[n] = sum(sim.per_rank_ops(res).values())
        saved[n] = res["saved"]
    # One heartbeat per 30 s, one abort check per 10 s, one notice check per step (1 s): ~1.13 per second.
    assert rates[256] <= rates[64] * 1.05 + 1e-9, rates
    assert rates[256] < 1.2, rates
    for n, by_rank in saved.items():  # every rank saved, all at one step, within two steps of the notice
        assert len(by_rank) == n
        assert len({step for step, _ in by_rank.values()}) == 1
        assert max(t for _, t in by_rank.values()) - 60.0 <= 2.0


def test_the_watchdog_reads_the_store_far_less_often_than_it_polls():
    dog = Watchdog(ProcessInfo(rank=3, world_size=16384, master_port=1), dist.HashStore())
    assert dog.poll_s == 1.0 and dog.check_s == 10.0 and dog.beat_s == 30.0
    assert dog.check_s <= dog.answer_s / 2  # every rank answers inside the reporter's window


def test_the_end_of_a_dispatched_pass_wakes_waiters_only_when_the_slowest_worker_moves(sim):
    wakes = 0

    class CountingCondition:
        def __init__(self, cond):
            self.cond = cond

        def __getattr__(self, name):
            return getattr(self.cond, name)

        def __enter__(self):
            return self.cond.__enter__()

        def __exit__(self, *exc):
            return self.cond.__exit__(*exc)

        def notify_all(self):
            nonlocal wakes
            wakes += 1
            self.cond.notify_all()

    original = Dispatcher.__init__

    def patched(self, server, *args, **kwargs):
        server.cond = CountingCondition(server.cond)
        original(self, server, *args, **kwargs)

    Dispatcher.__init__ = patched  # type: ignore[method-assign]
    try:
        res = sim.dispatch(64, batches_per_worker=4)
    finally:
        Dispatcher.__init__ = original  # type: ignore[method-assign]
    assert res["requests"] == 64 * 2  # one lease of 4 units, then the end of the pass
    assert wakes <= 8, wakes  # one per step the slowest worker moved on, not one per request (128)
