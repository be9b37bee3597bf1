"""Doc blocks marked <!-- same-on-2-replicas --> print the same numbers on 1 and on 2 Mirrored replicas, as
the README claims ("same seed, same data order, same global batch: the same losses")."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import towers
from doc_blocks import NUMBER, ROOT, markdown_files, python_blocks, run_block, run_block_here

pytestmark = pytest.mark.timeout(180)

SAME_MATHS = [b for p in markdown_files() for b in python_blocks(p) if b.mark == "same-on-2-replicas"]


@pytest.mark.parametrize("block", SAME_MATHS, ids=lambda b: b.name)
def test_block_prints_the_same_numbers_on_one_and_two_replicas(block, tmp_path):
    assert towers.cluster.from_env().world_size == 1  # so the block's strategy_from_env() is one_device here
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    with ThreadPoolExecutor(1) as pool:  # the 2 replicas start while one replica trains here: 3 processes' work on 2 cores
        job = pool.submit(towers.spawn, run_block, 2, args=(block.name, block.code, str(tmp_path / "two")),
                          timeout_s=150, env={"TOWERS_STRATEGY": "mirrored"}, threads_per_process=1)
        started = time.monotonic() + 30
        while len(multiprocessing.active_children()) < 2 and not job.done() and time.monotonic() < started:
            time.sleep(0.01)  # a replica starts in this process's working directory: change it only after they started
        one = run_block_here(block.name, block.code, str(tmp_path / "one"))
        two = job.result()
    assert two[1] == ""  # only the chief prints
    numbers_one, numbers_two = [float(v) for v in NUMBER.findall(one)], [float(v) for v in NUMBER.findall(two[0])]
    assert numbers_one and len(numbers_one) == len(numbers_two), (one, two[0])
    assert numbers_two == pytest.approx(numbers_one, rel=1e-4, abs=1e-5), (one, two[0])


def test_the_readme_claim_is_covered():
    assert any(b.path == ROOT / "README.md" for b in SAME_MATHS)
