"""examples/placement.py runs as a user would run it and shows placement, fallback and the op log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "placement.py"


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="the fallback path needs a host without /gpu:1")
def test_placement_example_falls_back_and_logs_ops():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "asked for /gpu:1, placed on /cpu:0" in out
    assert "warning: Device /gpu:1 is not available" in out
    assert "hard placement: Device /gpu:7 is not available" in out
    assert "placement: aten::addmm -> /cpu:0" in out
