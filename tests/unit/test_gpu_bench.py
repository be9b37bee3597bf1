"""``make gpu-bench`` (benchmarks/gpu_bench.py) without a GPU: its smoke run writes every part with numbers, and the
plain command skips with a reason and exit code 0.

The GPU numbers themselves need a GPU; here the code paths run at tiny sizes on the CPU, and the
parts' own decisions (a missing option, an out-of-memory policy) are checked with stand-ins.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_support import clean_env

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "gpu_bench.py"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.timeout(120)
def test_the_smoke_run_writes_every_part_with_numbers(tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=clean_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seconds = time.monotonic() - started
    report = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert report["skipped"] is None and report["device"] == "cpu" and report["torch"] == torch.__version__
    a, b, c = (report["parts"][k] for k in "abc")
    assert [r["engine"] for r in a["rows"]] == ["raw", "loop", "trainer"], a
    for row in a["rows"]:
        assert all(_number(row[k]) for k in ("tokens_s", "mfu", "vs_raw")), row
    assert _number(a["flops_per_token"]) and a["activation_checkpointing"] == "block"
    assert [r["engine"] for r in b["rows"]] == ["raw", "loop", "trainer"], b
    assert all(_number(r["examples_s"]) and _number(r["vs_raw"]) for r in b["rows"]), b
    configs = [r["config"] for r in c["rows"]]
    assert configs[:4] == ["off", "block", "selective", "block, by hand (raw torch)"], configs
    assert "FullyShardedStrategy(cpu_offload=True)" in configs[4]
    for row in c["rows"]:
        assert row["status"] == "ok" and _number(row["step_s"]), row
    markdown = (tmp_path / "gpu-bench.md").read_text()
    for heading in ("## (a) MFU", "## (b) The Trainer", "## (c) Memory policies", "33-39% MFU", "--device cpu --tiny"):
        assert heading in markdown
    assert seconds < 60, f"the smoke run took {seconds:.0f} s"


@pytest.mark.timeout(60)
def test_without_a_gpu_the_command_skips_with_a_reason_and_exit_code_0(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH), "--out-dir", str(tmp_path)], cwd=ROOT,
                          env=clean_env({"CUDA_VISIBLE_DEVICES": ""}), capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "skipped: no GPU" in done.stdout
    report = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert report["skipped"].startswith("skipped: no GPU") and report["parts"] == {}
    assert "skipped: no GPU" in (tmp_path / "gpu-bench.md").read_text()


@pytest.fixture
def gpt_parts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import _gpu_bench_gpt

    return _gpu_bench_gpt


def test_a_towers_without_activation_checkpointing_is_detected_by_the_typeerror(gpt_parts, monkeypatch):
    import towers

    assert gpt_parts.towers_has_ac(torch.device("cpu"))

    def old_prepare(self, model, optimizer=None, *, compile=False):
        return model, optimizer
    monkeypatch.setattr(towers.OneDeviceStrategy, "prepare", old_prepare)
    assert not gpt_parts.towers_has_ac(torch.device("cpu"))


def test_a_policy_that_runs_out_of_memory_is_a_row_not_a_failure(gpt_parts):
    from towers.models_gpt import GPTConfig

    recipe = gpt_parts.gpt_recipe(GPTConfig.tiny(), torch.device("cpu"), batch=4, steps=1, compile=False, policy="off")

    def step_out_of_memory() -> int:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def build_out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
    deadline = time.monotonic() + 30
    row = gpt_parts.one_config("off", recipe, torch.device("cpu"), repeats=1, deadline=deadline,
                               make=lambda: step_out_of_memory)
    assert row["status"] == "OOM at batch 4" and row["peak_gib"] is None
    row = gpt_parts.one_config("off", recipe, torch.device("cpu"), repeats=1, deadline=deadline, make=build_out_of_memory)
    assert row["status"] == "OOM at batch 4 (building)"
    row = gpt_parts.one_config("off", recipe, torch.device("cpu"), repeats=1, deadline=time.monotonic() - 1,
                               make=build_out_of_memory)
    assert row["status"].startswith("not run")
