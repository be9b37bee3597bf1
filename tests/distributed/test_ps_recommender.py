"""examples/recommender.py, small: Trainer.fit under HybridStrategy (2 workers + 1 ps) matches one process.

The same AUC as one process with a plain table (within 0.002; the maths is the same), bytes on
the ps links within 1.1x of the touched rows' values, and rows on the ps task.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "recommender.py"
SMALL = ["--rows", "4096", "--dim", "16", "--fields", "4", "--vocab", "500", "--train-examples", "4096",
         "--eval-examples", "2048", "--batch", "256"]


def _run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, str(EXAMPLE), *SMALL, *extra, "--json", str(out)], capture_output=True,
                          text=True, timeout=170, start_new_session=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())["results"]


def test_recommender_hybrid_fit_matches_one_process(tmp_path):
    hybrid = _run(tmp_path, "hybrid", "--strategy", "hybrid", "--workers", "2", "--num-ps", "1")
    one = _run(tmp_path, "one", "--strategy", "one_device")[0]
    workers, ps = hybrid[:2], hybrid[2]
    assert ps["role"] == "ps" and 0 < ps["tables"][0]["touched"] <= 4096
    for w in workers:
        assert abs(w["auc"] - one["auc"]) <= 0.002, (w["auc"], one["auc"])
        assert w["auc"] > 0.55 and w["oracle_auc"] > w["auc"]  # it learned; the true logit ranks better
        assert 1.0 <= w["wire_over_ideal"] <= 1.1, w
