"""The README's checkpoint recipe, as written, under every strategy it claims, and resumed under another.

The block runs under ``towers launch`` on one device, 2 Mirrored replicas, 2 sharded and 2 hybrid
workers (+1 ps task): all four print the same final loss (same maths). Then the newest checkpoint
of a run is deleted and the block runs again in that folder under another strategy (mirrored's
under sharded, hybrid's on one device): it resumes at the previous checkpoint and ends with the
same loss and the same checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_support import run, towers_command
from doc_blocks import ROOT, python_blocks
from towers.checkpoint import delete_checkpoint

pytestmark = pytest.mark.timeout(300)

RECIPE = next(b for b in python_blocks(ROOT / "README.md") if 'CheckpointManager("ckpt/loop"' in b.code)
LAUNCH = {"one_device": ["--nproc-per-node", "1"],
          "mirrored": ["--nproc-per-node", "2", "--strategy", "mirrored"],
          "sharded": ["--nproc-per-node", "2", "--strategy", "sharded"],
          "hybrid": ["--nproc-per-node", "3", "--strategy", "hybrid", "--num-ps", "1"]}
_LINE = re.compile(r"step (\d+): loss (-?\d+\.\d+); checkpoints (\[.*\])")


def _run(kind: str, work: Path) -> tuple[int, float, str]:
    work.mkdir(exist_ok=True)
    script = work / "recipe.py"
    script.write_text(RECIPE.code)
    done = run([*towers_command(), "launch", *LAUNCH[kind], str(script)], cwd=work, deadline_s=120,
               marker=str(script))
    assert done.returncode == 0, f"{kind}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    lines = [m for m in map(_LINE.search, done.stdout.splitlines()) if m]
    assert len(lines) == 1, f"{kind}: only the chief prints, once:\n{done.stdout[-2000:]}"
    step, loss, kept = lines[0].groups()
    return int(step), float(loss), kept


def test_the_readme_recipe_runs_and_resumes_under_every_strategy(tmp_path):
    results = {kind: _run(kind, tmp_path / kind) for kind in LAUNCH}
    step, loss, kept = results["one_device"]
    assert step == 12 and kept == "['ckpt-9', 'ckpt-12']"
    for kind, (other_step, other_loss, other_kept) in results.items():
        assert (other_step, other_kept) == (step, kept), kind
        assert other_loss == pytest.approx(loss, abs=2e-4), kind  # the same maths as one device

    for written, resumed in (("mirrored", "sharded"), ("hybrid", "one_device")):
        folder = tmp_path / written
        delete_checkpoint(folder / "ckpt" / "loop" / "ckpt-12")  # as if the job had died after step 9's save
        again = _run(resumed, folder)
        assert again[0] == 12 and again[2] == kept, (written, resumed)
        assert again[1] == pytest.approx(loss, abs=2e-4), (written, resumed)
