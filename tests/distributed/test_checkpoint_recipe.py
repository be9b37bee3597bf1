"""The checkpoint recipe of docs/checkpoints.md, as written, under every strategy it claims, and resumed under another.

The block runs on one device (``python recipe.py``, as the block's first comment says) and under
``towers launch`` on 2 Mirrored replicas, 2 sharded and 2 hybrid workers (+1 ps task): all four
print the same final loss (same maths). Then the newest checkpoint of a run is deleted and the
block runs again in that folder under another strategy (mirrored's under sharded, hybrid's on one
device): it resumes at the previous checkpoint and ends with the same loss and the same
checkpoints. Independent runs go two at a time, each in its own folder, on its own port.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_support import finish, start, towers_command
from doc_blocks import ROOT, python_blocks
from towers.checkpoint import delete_checkpoint
from towers.launch import free_port

pytestmark = pytest.mark.timeout(300)

RECIPE = next(b for b in python_blocks(ROOT / "docs" / "checkpoints.md") if 'CheckpointManager("ckpt/loop"' in b.code)
LAUNCH = {"one_device": None,  # no launcher: `python recipe.py`
          "mirrored": ["--nproc-per-node", "2", "--strategy", "mirrored"],
          "sharded": ["--nproc-per-node", "2", "--strategy", "sharded"],
          "hybrid": ["--nproc-per-node", "3", "--strategy", "hybrid", "--num-ps", "1"]}
_LINE = re.compile(r"step (\d+): loss (-?\d+\.\d+); checkpoints (\[.*\])")


def _start(kind: str, work: Path, port: int) -> subprocess.Popen:
    work.mkdir(exist_ok=True)
    script = work / "recipe.py"
    script.write_text(RECIPE.code)
    launch = ([*towers_command(), "launch", "--master-port", str(port), *LAUNCH[kind]] if LAUNCH[kind]
              else [sys.executable])
    return start([*launch, str(script)], cwd=work)


def _runs(jobs: list[tuple[str, Path]], marker: Path) -> list[tuple[int, float, str]]:
    """Run the recipe for each (kind, folder) side by side and return each chief's (step, loss, checkpoints).

    Side by side: a launch spends seconds on one core (the launcher's own start) while the other idles."""
    ports: set[int] = set()
    while len(ports) < len(jobs):  # launches side by side need different ports
        ports.add(free_port())
    procs = [_start(kind, work, port) for (kind, work), port in zip(jobs, ports)]
    results = []
    for (kind, _), done in zip(jobs, finish(procs, deadline_s=150, marker=str(marker))):
        assert done.returncode == 0, f"{kind}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        lines = [m for m in map(_LINE.search, done.stdout.splitlines()) if m]
        assert len(lines) == 1, f"{kind}: only the chief prints, once:\n{done.stdout[-2000:]}"
        step, loss, kept = lines[0].groups()
        results.append((int(step), float(loss), kept))
    return results


def test_the_readme_recipe_runs_and_resumes_under_every_strategy(tmp_path):
    results = {}
    for pair in (("one_device", "hybrid"), ("mirrored", "sharded")):  # two at a time, on a machine of 2 cores
        results.update(zip(pair, _runs([(kind, tmp_path / kind) for kind in pair], tmp_path)))
    step, loss, kept = results["one_device"]
    assert step == 12 and kept == "['ckpt-9', 'ckpt-12']"
    for kind, (other_step, other_loss, other_kept) in results.items():
        assert (other_step, other_kept) == (step, kept), kind
        assert other_loss == pytest.approx(loss, abs=2e-4), kind  # the same maths as one device

    resumes = (("mirrored", "sharded"), ("hybrid", "one_device"))
    for written, _ in resumes:
        delete_checkpoint(tmp_path / written / "ckpt" / "loop" / "ckpt-12")  # as if the job had died after step 9's save
    for (written, resumed), again in zip(resumes, _runs([(resumed, tmp_path / written) for written, resumed in resumes],
                                                        tmp_path)):
        assert again[0] == 12 and again[2] == kept, (written, resumed)
        assert again[1] == pytest.approx(loss, abs=2e-4), (written, resumed)
