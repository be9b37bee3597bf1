"""Doc blocks marked <!-- same-on-2-replicas --> print the same numbers on 1 and on 2 Mirrored replicas, as
the README claims ("same seed, same data order, same global batch: the same losses")."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

import towers
from doc_blocks import ROOT, markdown_files, python_blocks

pytestmark = pytest.mark.timeout(180)

SAME_MATHS = [b for p in markdown_files() for b in python_blocks(p) if b.mark == "same-on-2-replicas"]
_NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")


def _run_block(name: str, code: str, work_dir: str) -> str:
    os.chdir(work_dir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    return out.getvalue()


@pytest.mark.parametrize("block", SAME_MATHS, ids=lambda b: b.name)
def test_block_prints_the_same_numbers_on_one_and_two_replicas(block, tmp_path):
    one = towers.spawn(_run_block, 1, args=(block.name, block.code, str(tmp_path)), timeout_s=120,
                       threads_per_process=1)[0]
    two = towers.spawn(_run_block, 2, args=(block.name, block.code, str(tmp_path)), timeout_s=150,
                       env={"TOWERS_STRATEGY": "mirrored"}, threads_per_process=1)
    assert two[1] == ""  # only the chief prints
    numbers_one, numbers_two = [float(v) for v in _NUMBER.findall(one)], [float(v) for v in _NUMBER.findall(two[0])]
    assert numbers_one and len(numbers_one) == len(numbers_two), (one, two[0])
    assert numbers_two == pytest.approx(numbers_one, rel=1e-4, abs=1e-5), (one, two[0])


def test_the_readme_claim_is_covered():
    assert any(b.path == ROOT / "README.md" for b in SAME_MATHS)
