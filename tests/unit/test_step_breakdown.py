"""The step breakdown on one process: the phases a plain loop's step is made of, the Trainer's default, and the
straggler detector on synthetic reports (100 of an even job: no false alarm)."""

from __future__ import annotations

import io
import logging
import math
import os
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.callbacks import StepBreakdown
from towers.diagnostics.breakdown import PHASES, StepTimer, measured_step
from towers.diagnostics.step_breakdown import BreakdownReport
from towers.diagnostics.straggler import StragglerDetector


def _busy(cpu_seconds: float) -> None:
    """Use ``cpu_seconds`` of this thread's CPU time (a sleep would use none; wall time would shrink it when the
    machine is busy: CPU time does not pass while the thread waits)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


class _Timed(nn.Module):
    """Forward: 20 ms of CPU work, then 30 ms asleep (what waiting for a peer looks like to this thread)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        _busy(0.02)
        time.sleep(0.03)
        return self.linear(x)


def _three_steps(model: nn.Module, *, communicates: bool) -> tuple[dict[str, float], float]:
    """Three steps of a plain torch loop, timed from outside as a user would: each phase's seconds, and the wall time."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = StepTimer("cpu", on_update=lambda: None, communicates=communicates)
    timer.attach(model, optimizer)
    timer.arm(True)
    x = torch.randn(8, 4)
    began = time.perf_counter()
    for _ in range(3):
        timer.input_begin()
        _busy(0.005)
        timer.input_end()
        model(x).sum().backward()
        optimizer.step()  # the step ends here (on_update)
        optimizer.zero_grad()
    wall = time.perf_counter() - began
    steps, sums = timer.take()
    timer.detach()
    assert steps == 3
    return dict(zip(PHASES, sums)), wall


def test_a_steps_phases_add_up_and_a_sleep_in_forward_is_comm_wait_in_a_job_that_communicates():
    got, wall = _three_steps(_Timed(), communicates=True)
    # Bounds that hold however busy the machine is: CPU time is the work done, a sleep lasts at least as asked, and
    # what a busy machine adds (waiting for a core) goes to cpu_wait, never to the compute phases.
    assert 3 * (0.005 + 0.02 + 0.03) <= sum(got.values()) <= wall  # the phases are the steps, no gaps
    assert 0.06 <= got["forward"] <= 0.06 + 0.03  # the busy part's CPU time (and the hooks')
    assert got["comm_wait"] >= 0.09 - 0.005  # the sleeps: asleep, as a thread waiting for a peer is
    assert got["input"] >= 0.015 and got["cpu_wait"] >= 0.0


def test_one_replica_has_no_comm_wait_its_sleeps_are_other():
    got, _ = _three_steps(_Timed(), communicates=False)
    assert got["comm_wait"] == 0.0  # nothing to communicate with: never "communication"
    assert got["other"] >= 0.09 - 0.005 and 0.06 <= got["forward"] <= 0.09


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's per-thread scheduler statistics and CPU affinity")
def test_waiting_for_a_busy_core_is_cpu_wait_not_comm_wait():
    class _Busy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1)

        def forward(self, x):
            _busy(0.02)
            return self.linear(x)

    before = os.sched_getaffinity(0)
    core = min(before)
    # A process that never sleeps on the one core this thread may use: the thread waits its turn for that core.
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}}); print('on', flush=True)"
                            "\nwhile True: pass"], stdout=subprocess.PIPE)
    try:
        assert hog.stdout is not None and hog.stdout.readline() == b"on\n"  # it runs on that core from here
        os.sched_setaffinity(0, {core})
        got, _ = _three_steps(_Busy(), communicates=True)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait(timeout=30)
        hog.stdout.close()
    # 60 ms of CPU work sharing one core with a process that never yields: it waited about as long for the core.
    assert got["cpu_wait"] >= 0.01, got
    assert got["comm_wait"] < got["cpu_wait"], got
    assert 0.06 <= got["forward"] <= 0.09


def test_the_report_is_taken_over_the_steps_before_it():
    assert [s for s in range(1, 101) if measured_step(s, 50)] == [*range(40, 50), *range(90, 100)]
    assert all(measured_step(s, 1) for s in range(1, 5))
    assert [s for s in range(1, 9) if measured_step(s, 4)] == [1, 2, 3, 5, 6, 7]


def _fit(steps: int, **options) -> tuple[towers.Trainer, dict]:
    torch.manual_seed(0)
    x = torch.randn(8 * steps, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    callbacks = options.pop("callbacks", [])
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"), **options)
    history = trainer.fit((x, y), 1, 8, callbacks=callbacks)
    return trainer, history.history


def test_the_trainer_reports_by_default_and_not_when_turned_off(caplog):
    with caplog.at_level(logging.INFO, logger="towers.diagnostics.step_breakdown"):
        _, on = _fit(100)  # the default period: 100 steps
    lines = [r.getMessage() for r in caplog.records if r.name == "towers.diagnostics.step_breakdown"]
    assert len(lines) == 1 and lines[0].startswith("step breakdown at step 100, ms per step over the last 10 step(s)")
    # One replica: the phases it has (no comm_wait: it communicates with no one).
    assert {f"time/{p}" for p in PHASES if p != "comm_wait"} <= set(on) and 0 < on["time/forward"][0] < 1
    assert "time/comm_wait" not in on and "time/cpu_wait" in on and "comm_wait" not in lines[0]
    _, off = _fit(100, breakdown_every=0)
    assert not any(k.startswith("time/") for k in off)


def test_a_users_breakdown_replaces_the_default_and_keeps_the_callbacks_order():
    mine = StepBreakdown(3)
    stop = towers.callbacks.EarlyStopping("loss", patience=5)
    trainer, history = _fit(7, callbacks=[stop, mine], breakdown_every=0)
    assert mine.last_report is not None and mine.last_report.global_step == 6
    assert len(history["time/backward"]) == 1
    # What fit keeps (and checkpoints callback states by) is its list as given: indices do not move.
    assert list(trainer._callbacks) == [trainer.history, stop, mine]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_a_bad_period_is_refused(bad):
    with pytest.raises(ValueError, match="breakdown_every must be"):
        towers.Trainer(nn.Linear(2, 1), None, strategy=towers.OneDeviceStrategy("cpu"), breakdown_every=bad)
    with pytest.raises(ValueError, match="every must be a positive integer"):
        StepBreakdown(0 if bad == -1 else bad)


def test_no_false_alarm_in_100_reports_of_an_even_job():
    rng = random.Random(0)
    detector = StragglerDetector()
    named = []
    for _ in range(100):  # 8 ranks; each report's per-rank means jitter by ~12% (a busy shared machine: 8 single
        # reports flag a rank 25% above the others, none 3 times in 5)
        forward = [0.004 * rng.lognormvariate(0, 0.12) for _ in range(8)]
        backward = [0.009 * rng.lognormvariate(0, 0.12) for _ in range(8)]
        named += detector.observe(forward, backward, [f"host-{r // 4}" for r in range(8)])
    assert named == []


def test_a_consistently_slow_rank_is_named_at_the_third_report_once_per_window():
    rng = random.Random(1)
    detector = StragglerDetector()  # 25% above the others' median in 3 of the last 5 reports
    hosts = ["host-a", "host-a", "host-b", "host-b"]
    found = []
    for report in range(1, 11):
        forward = [0.004 * rng.lognormvariate(0, 0.01) for _ in range(4)]
        backward = [0.009 * rng.lognormvariate(0, 0.01) for _ in range(4)]
        backward[2] *= 1.41
        found += [(report, s) for s in detector.observe(forward, backward, hosts)]
    assert [r for r, _ in found] == [3, 8]  # named, then again after 5 more reports (not at every report)
    straggler = found[0][1]
    assert (straggler.rank, straggler.host, straggler.phase) == (2, "host-b", "backward")
    assert straggler.slower == pytest.approx(0.41, abs=0.06)
    assert straggler.message().startswith("rank 2 on host-b: backward 4")
    assert straggler.message().endswith("slower than the median ("
                                        f"{1000 * straggler.seconds:.1f} ms vs {1000 * straggler.median_seconds:.1f} "
                                        "ms per step); the others wait for it in the all-reduce")


def test_a_single_slow_report_is_not_a_straggler():
    detector = StragglerDetector()
    for report in range(10):
        backward = [0.01, 0.01, 0.02 if report == 4 else 0.01]  # one blip: a neighbour's job, a GC pause
        assert detector.observe([0.004] * 3, backward, None) == []


def test_the_summary_names_the_slowest_rank_of_each_phase():
    nan = float("nan")
    report = BreakdownReport(global_step=50, steps=[9, 9, 0], hosts=["a", "b", "c"], stragglers=[],
                             seconds=[[0.001, 0.004, 0.009, 0.002, 0.0, 0.001, 0.0005],
                                      [0.002, 0.006, 0.010, 0.001, 0.003, 0.001, 0.0005], [nan] * 7])
    assert report.logs()["time/forward"] == pytest.approx(0.005) and report.logs()["time/forward_max"] == 0.006
    assert report.summary() == (
        "step breakdown at step 50, ms per step over the last 9 step(s), median/max rank of 3: input 1.5/2.0 (r1), "
        "forward 5.0/6.0 (r1), backward 9.5/10.0 (r1), comm_wait 1.5/2.0 (r0), cpu_wait 1.5/3.0 (r1), "
        "optimizer 1.0/1.0 (r1), other 0.5/0.5 (r1)")
    alone = BreakdownReport(global_step=50, steps=[9], hosts=["a"], stragglers=[], communicates=False,
                            seconds=[[0.001, 0.004, 0.009, 0.0, 0.002, 0.001, 0.0005]])
    assert "comm_wait" not in alone.summary() and "cpu_wait 2.0/2.0 (r0)" in alone.summary()
    assert "time/comm_wait" not in alone.logs() and alone.logs()["time/cpu_wait"] == 0.002


def test_an_epoch_line_stays_short_and_the_history_keeps_the_breakdown_of_the_epoch_it_was_measured_in(caplog):
    """3 epochs of 2 steps, a report every 4 steps: measured in epoch 2 only. The progress line of no epoch carries
    the time/<phase> keys (they are the breakdown's own line); the History has them for epoch 2, NaN elsewhere."""
    stream = io.StringIO()
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"), metrics=["accuracy"])
    with caplog.at_level(logging.INFO, logger="towers.diagnostics.step_breakdown"):
        history = trainer.fit((x, y), 3, 16, callbacks=[StepBreakdown(4), towers.callbacks.ProgressBar(
            mode="epoch", stream=stream)]).history
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"epoch {i + 1}/3: loss ") for i, line in enumerate(lines))
    assert not any("time/" in line for line in lines), lines
    breakdown = [r for r in caplog.records if r.name == "towers.diagnostics.step_breakdown"]  # not MFU's first line
    assert [r.getMessage().split(",")[0] for r in breakdown] == ["step breakdown at step 4"]  # its own line
    forward = history["time/forward"]
    assert math.isnan(forward[0]) and forward[1] > 0 and math.isnan(forward[2])
