"""examples/sharded.py runs as a user would run it (one process here; 2 and 4 are the distributed tests' job):
it trains, writes a sharded checkpoint, resumes from it and exports the full model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import towers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharded.py"


def test_sharded_example_trains_resumes_and_exports(tmp_path):
    def run(*extra: str) -> str:
        done = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path), *extra], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout

    first = run("--epochs", "1", "--sequences", "32")
    assert "sharded: 1 replica(s)" in first and "epoch 1: loss" in first
    resumed = run("--epochs", "2", "--resume", "--sequences", "32")
    assert "resumed from" in resumed and "at epoch 1" in resumed and "epoch 2: loss" in resumed
    assert "epoch 1: loss" not in resumed  # the finished epoch is not trained again
    weights = towers.checkpoint.load_exported(tmp_path / "model.safetensors")
    assert weights["head.weight"].shape == (97, 32) and torch.isfinite(weights["head.weight"]).all()
