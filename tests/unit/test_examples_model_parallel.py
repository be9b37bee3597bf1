"""examples/model_parallel.py runs as a user would run it: two stages placed by towers.device, trained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_parallel.py"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="the fallback path needs a host without GPUs")
def test_model_parallel_example_falls_back_to_cpu_with_one_warning_per_device():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "20"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stage0: asked for /gpu:0, placed on /cpu:0" in out
    assert "stage1: asked for /gpu:1, placed on /cpu:0" in out
    # One SoftPlacementWarning per missing device, at the line that asked for it; none per step.
    warnings = [line for line in done.stderr.splitlines() if "SoftPlacementWarning" in line]
    assert len(warnings) == 2, done.stderr
    assert "Device /gpu:0 is not available" in warnings[0] and "Device /gpu:1 is not available" in warnings[1]
    first, last = (float(v) for v in out.split("loss ")[1].split(" after")[0].split(" -> "))
    assert last < first  # the two stages train together: gradients flow back across the hand-off
