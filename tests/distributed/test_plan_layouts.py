"""``towers plan --mesh`` against the real job: within 20% of each rank's measured peak under dp=2,tp=2 and pp=2,dp=2.

One spawn of 4 CPU processes per layout runs ``benchmarks/plan_accuracy.py``'s job
(``FullyShardedStrategy(mesh=...)``, towers' GPT of ~5.3M parameters, Adam, 3 steps) and measures
each rank's peak of live tensor bytes as ``tests/distributed/test_plan.py`` does (a
``TorchDispatchMode`` over every storage an op returns: deterministic, the same on every run);
``estimate_layout`` must be within 20% of it on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import towers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_accuracy  # noqa: E402  (the benchmark's job and measurement, shared)

pytestmark = pytest.mark.timeout(240)

TOLERANCE = 0.20


@pytest.mark.parametrize("mesh", plan_accuracy.LAYOUTS)
def test_layout_estimate_within_20_percent_of_each_ranks_peak(mesh):
    measured = towers.spawn(plan_accuracy.measure, plan_accuracy.WORLD_SIZE, args=(mesh,), timeout_s=180,
                            threads_per_process=1)
    estimated = plan_accuracy.estimate(mesh)
    table = "\n".join(f"{mesh} rank {r}: estimate {e / 2**20:.2f} MiB, measured {m / 2**20:.2f} MiB ({e / m:.3f})"
                      for r, (e, m) in enumerate(zip(estimated, measured)))
    assert all(abs(e - m) <= TOLERANCE * m for e, m in zip(estimated, measured)), table
