"""The step breakdown on 3 Mirrored replicas, one of them slowed on purpose (matmuls in its forward until it has
used 20 ms more of its thread's CPU time per step; not a sleep: a sleep uses no CPU time). The chief names rank 2 and
its host within 3 reports, in the Trainer and in a custom loop; every rank gets the same ``time/<phase>`` logs.

Deterministic under any machine load: the detector compares CPU time, which does not pass while a thread waits for a
core, and the slowdown is counted in CPU time too, so a busy machine stretches every rank's wall time but leaves rank
2 about 20 ms of compute per step above the others' ~1 ms (the threshold is 25%). A slowdown of a fixed amount of work
(40 small matmuls, ~0.7 ms) was within the noise of the first report's warm-up steps when another program kept a core
busy, and the test then saw no straggler 5 times in 12.
"""

from __future__ import annotations

import logging
import socket
import time

import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.diagnostics.breakdown import PHASES

EVERY, REPORTS = 4, 3
SLOWER_S = 0.02  # rank 2's extra CPU time per forward


class _Net(nn.Module):
    def __init__(self, slow: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
        self.slow = slow
        self.busy = torch.randn(96, 96)

    def forward(self, x):
        if self.slow:  # SLOWER_S of CPU work on this rank only: forward is its slow phase
            end = time.thread_time() + SLOWER_S
            while time.thread_time() < end:
                torch.mm(self.busy, self.busy)
        return self.body(x)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _replica():
    torch.set_num_threads(1)
    strategy = towers.strategy_from_env()
    rank = strategy.replica_id
    lines = _Lines()
    logger = logging.getLogger("towers.diagnostics.step_breakdown")
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24 * EVERY * REPORTS, 16, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    with strategy.scope():
        model = _Net(slow=rank == 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    breakdown = towers.callbacks.StepBreakdown(EVERY)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, strategy=strategy)
    history = trainer.fit((x, y), 1, 24, callbacks=[breakdown])  # 12 steps: reports at steps 4, 8, 12
    fit_named = [s.message() for s in breakdown.last_report.stragglers]
    fit_lines = list(lines.lines)
    lines.lines.clear()

    # The custom loop's switch, on the prepared model and optimizer of the same Trainer.
    loop = towers.diagnostics.StepBreakdown(trainer.model, trainer.optimizer, strategy, every=EVERY)
    named_at = None
    for xb, yb in loop.timed(strategy.distribute_dataset(torch.utils.data.TensorDataset(x, y), 24, seed=1)):
        loss = towers.compute_average_loss(F.cross_entropy(trainer.model(xb), yb, reduction="none"))
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        if named_at is None and loop.last_report is not None and loop.last_report.stragglers:
            named_at = loop.updates // EVERY
    report = loop.last_report
    loop.close()
    strategy.barrier()
    return {"rank": rank, "host": socket.gethostname(), "history": history.state_dict(), "fit_named": fit_named,
            "fit_lines": fit_lines, "loop_named_at": named_at, "loop_lines": list(lines.lines),
            "loop_seconds": report.seconds, "loop_steps": report.steps}


def test_a_slowed_rank_is_named_within_three_reports():
    results = towers.spawn(_replica, 3, timeout_s=120, env={"TOWERS_STRATEGY": "mirrored"})
    chief, host = results[0], results[0]["host"]
    # The same reduced time/<phase> logs on every rank, one pair of keys per phase.
    assert results[0]["history"] == results[1]["history"] == results[2]["history"]
    keys = {k for k in results[0]["history"]["history"] if k.startswith("time/")}
    assert keys == {f"time/{p}" for p in PHASES} | {f"time/{p}_max" for p in PHASES}
    # The Trainer: named at the third report (k=3 of m=5), by the chief only, with its host and phase.
    warnings = [m for level, m in chief["fit_lines"] if level == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"straggler: rank 2 on {host}: forward "), warnings
    assert "slower than the median" in warnings[0] and "wait for it in the all-reduce" in warnings[0]
    summaries = [m for level, m in chief["fit_lines"] if level == "INFO"]
    assert len(summaries) == REPORTS and all("forward" in m and "(r2)" in m for m in summaries), summaries
    assert results[1]["fit_lines"] == [] and results[2]["fit_lines"] == []
    assert chief["fit_named"] and results[1]["fit_named"] == chief["fit_named"]  # every rank knows
    # The custom loop: named within 3 reports too; rank 2's forward is the slowest by far.
    assert chief["loop_named_at"] is not None and chief["loop_named_at"] <= REPORTS
    forward = [row[PHASES.index("forward")] for row in chief["loop_seconds"]]
    assert forward[2] >= SLOWER_S and forward[2] > 2 * max(forward[:2]), forward
    assert all(steps == EVERY - 1 for steps in chief["loop_steps"])  # the report's own step is not measured
