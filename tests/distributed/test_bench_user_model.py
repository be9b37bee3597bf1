"""`towers bench --model module:factory`: the user's own model and data, measured like the built-in workload."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from cli_support import run

pytestmark = pytest.mark.timeout(150)

USER_MODULE = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                             nn.Linear(16, 5))

    def data():
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.TensorDataset(torch.randn(24, 3, 12, 12, generator=g),
                                              torch.randint(0, 5, (24,), generator=g))
""")


def test_bench_measures_the_users_model_on_the_users_data(tmp_path):
    (tmp_path / "mymodels.py").write_text(USER_MODULE)  # a module in the user's working directory
    out_dir = tmp_path / "bench"
    result = run([sys.executable, "-m", "towers", "bench", "--model", "mymodels:build", "--dataset", "mymodels:data",
                  "--replicas", "1,2", "--steps", "2", "--warmup", "1", "--repeats", "1", "--batch-size", "4",
                  "--out-dir", str(out_dir), "--no-plot"], cwd=tmp_path, deadline_s=120)
    assert result.returncode == 0, result.stderr
    assert "mymodels:build: Sequential, 197 parameters, input (3, 12, 12), output (5,)" in result.stderr
    assert "model: mymodels:build (input 1x28x28, data mymodels:data, loss cross_entropy)" in result.stdout
    data = json.loads((out_dir / "bench.json").read_text())
    assert data["config"]["model"] == "mymodels:build" and data["config"]["dataset"] == "mymodels:data"
    rows = {(r["strategy"], r["replicas"]): r for r in data["rows"]}
    assert set(rows) == {("raw_ddp", 1), ("mirrored", 1), ("raw_ddp", 2), ("mirrored", 2)}
    for row in rows.values():  # what the built-in workload reports, for the user's model
        assert row["median"] > 0 and row["cpu_ms"] > 0 and row["memory_mib"] > 0
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["replicas"])
    assert rows[("mirrored", 2)]["engine"] == "MirroredStrategy" and rows[("mirrored", 2)]["vs_raw"] > 0
