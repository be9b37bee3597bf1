"""`towers demo` as a user runs it: a real CLI process in its own session, with a deadline."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

from cli_support import run, towers_command


def _towers(*args: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    return run([*towers_command(), *args], cwd=cwd, deadline_s=timeout_s)


def test_demo_one_epoch_trains_on_1_and_2_replicas_and_measures_weak_scaling(tmp_path):
    out_dir = tmp_path / "demo"
    result = _towers("demo", "--epochs", "1", "--out-dir", str(out_dir), "--scaling-steps", "5",
                     "--scaling-repeats", "1", cwd=tmp_path, timeout_s=240)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "[1/3] 1 replica (one_device)" in out and "[2/3] 2 replicas (mirrored, 2 processes)" in out
    assert "[3/3] speed: 1 vs 2 replicas, 64 examples per replica per step (weak scaling)" in out
    accuracies = [float(line.split()[-1]) for line in out.splitlines() if line.strip().startswith("test accuracy")]
    assert len(accuracies) == 2 and accuracies[0] == pytest.approx(accuracies[1], abs=1e-6) and accuracies[0] > 0.5
    same_maths = [line.split() for line in out.splitlines() if line.strip().startswith(("1  one_device", "2  mirrored"))]
    assert [row[:2] for row in same_maths] == [["1", "one_device"], ["2", "mirrored"]]
    assert same_maths[0][3] == same_maths[1][3]  # final loss: the same curve
    speed = out[out.index("speed: weak scaling, 64 examples per replica per step"):]
    rows = [line.split() for line in speed.splitlines()[2:4]]
    assert [r[0] for r in rows] == ["1", "2"] and rows[0][2:] == ["1.00x", "1.00"]
    examples_per_s = [float(r[1].replace(",", "")) for r in rows]
    speedup = float(rows[1][2].rstrip("x"))
    assert all(v > 0 for v in examples_per_s) and speedup == pytest.approx(examples_per_s[1] / examples_per_s[0], rel=0.35)
    strong = [line for line in out.splitlines() if line.startswith("Strong scaling")]
    assert len(strong) == 1 and "global batch of 64 split 2 ways, 32 per replica) measured" in strong[0]
    assert "epoch 1/1: loss" in result.stderr and "examples/s" in result.stderr  # progress, on the chief only
    assert result.stderr.count("epoch 1/1: loss") == 2
    rows = list(csv.DictReader(open(out_dir / "history.csv")))
    assert [(r["replicas"], r["epoch"]) for r in rows] == [("1", "1"), ("2", "1")]
    assert float(rows[0]["loss"]) == pytest.approx(float(rows[1]["loss"]), rel=1e-5)  # same maths
    assert (out_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert f"{out_dir / 'history.csv'}" in out and f"{out_dir / 'loss.png'}" in out


def test_demo_rejects_bad_flags_with_exit_code_2(tmp_path):
    result = _towers("demo", "--replicas", "0", "--out-dir", str(tmp_path), cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2 and "--replicas must be a positive integer. Received: 0" in result.stderr
    result = _towers("demo", "--strategy", "ps", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2 and "--strategy must be one of" in result.stderr
    result = _towers("demo", "--scaling-repeats", "-1", cwd=tmp_path, timeout_s=60)
    assert result.returncode == 2 and "--scaling-repeats must be an integer >= 0" in result.stderr
