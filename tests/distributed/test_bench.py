"""`towers bench` end to end: a tiny real run on 1 and 2 processes writes the table, JSON and PNG.

No timing assertions: the numbers are measurements, the test checks that they exist and add up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_support import run

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 90


def _run_cli(argv: list[str], cwd) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "towers.cli", *argv], cwd=cwd, deadline_s=DEADLINE_S)


def test_tiny_bench_run_produces_table_json_and_plot(tmp_path):
    out_dir = tmp_path / "bench"
    result = _run_cli(["bench", "--replicas", "1,2", "--strategies", "mirrored", "--steps", "2", "--warmup", "1",
                       "--repeats", "1", "--batch-size", "8", "--out-dir", str(out_dir)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = result.stdout
    assert "strategy" in table.splitlines()[0] and "vs raw DDP" in table.splitlines()[0]
    assert f"wrote {out_dir / 'bench.json'}" in table and f"wrote {out_dir / 'bench.png'}" in table
    # one job of 2 processes; the 1-replica baselines take turns with the 2-replica runs inside it
    assert "on 2 replica(s) (and both on 1 replica)" in result.stderr
    assert "repeat 1/1: examples/s raw_ddp@1" in result.stderr and "mirrored@1" in result.stderr

    data = json.loads((out_dir / "bench.json").read_text())
    rows = {(r["strategy"], r["replicas"]): r for r in data["rows"]}
    assert set(rows) == {("raw_ddp", 1), ("mirrored", 1), ("raw_ddp", 2), ("mirrored", 2)}
    assert rows[("raw_ddp", 1)]["engine"] == "torch (no DDP)" and rows[("raw_ddp", 2)]["engine"] == "torch DDP"
    assert rows[("mirrored", 1)]["engine"] == "OneDeviceStrategy"
    assert rows[("mirrored", 2)]["engine"] == "MirroredStrategy"
    for row in rows.values():
        assert row["median"] > 0 and row["cpu_ms"] > 0
        # one repeat: the per-repeat speed-up is the ratio of the two rows
        assert row["speedup"] == pytest.approx(row["median"] / rows[(row["strategy"], 1)]["median"])
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["replicas"])
    for n in (1, 2):
        assert rows[("mirrored", n)]["vs_raw"] == pytest.approx(
            rows[("mirrored", n)]["median"] / rows[("raw_ddp", n)]["median"])
    assert data["config"]["batch_size"] == 8 and data["config"]["repeats"] == 1
    assert (out_dir / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_job_past_its_deadline_fails_the_command_with_every_rank_named(tmp_path):
    result = _run_cli(["bench", "--replicas", "2", "--steps", "500", "--repeats", "1", "--timeout-s", "1",
                       "--no-plot", "--out-dir", str(tmp_path / "bench")], cwd=tmp_path)
    assert result.returncode == 1
    assert "towers bench: the benchmark job failed." in result.stderr
    assert "did not finish within timeout_s=1" in result.stderr
    assert "rank 0:" in result.stderr and "rank 1:" in result.stderr
    assert not (tmp_path / "bench" / "bench.json").exists()
