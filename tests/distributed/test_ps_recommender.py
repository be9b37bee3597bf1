"""examples/recommender.py, small: Trainer.fit under HybridStrategy (2 workers + 1 ps) matches one process.

Both stream the same click-log shards (towers.data.Shards, two epochs). The same AUC as one
process with a plain table (within 0.002; the maths is the same), bytes on the ps links within
1.1x of the touched rows' values, and rows on the ps task.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(200)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "recommender.py"
SMALL = ["--rows", "4096", "--dim", "16", "--fields", "4", "--vocab", "500", "--train-examples", "4096",
         "--eval-examples", "2048", "--batch", "256"]


def _run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, str(EXAMPLE), *SMALL, *extra, "--data-dir", str(tmp_path), "--json",
                           str(out)], capture_output=True, text=True, timeout=170, start_new_session=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())["results"]


def _one_process(data_dir: Path) -> dict:
    """The reference in this process: one device, a plain table (no second interpreter to start); the same shards."""
    spec = importlib.util.spec_from_file_location("recommender_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)
        args = dict(zip(SMALL[::2], SMALL[1::2]))
        cfg = module.Config(strategy="one_device", data_dir=str(data_dir),
                            **{k[2:].replace("-", "_"): int(v) for k, v in args.items()})
        return module.run(cfg)
    finally:
        del sys.modules[spec.name]
        torch.set_num_threads(threads)  # run() sets one thread per process


def test_recommender_hybrid_fit_matches_one_process(tmp_path):
    hybrid = _run(tmp_path, "hybrid", "--strategy", "hybrid", "--workers", "2", "--num-ps", "1")
    one = _one_process(tmp_path)
    workers, ps = hybrid[:2], hybrid[2]
    assert ps["role"] == "ps" and 0 < ps["tables"][0]["touched"] <= 4096
    for w in workers:
        assert abs(w["auc"] - one["auc"]) <= 0.002, (w["auc"], one["auc"])
        assert w["auc"] > 0.55 and w["oracle_auc"] > w["auc"]  # it learned; the true logit ranks better
        assert 1.0 <= w["wire_over_ideal"] <= 1.1, w
