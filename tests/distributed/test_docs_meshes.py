"""The README's custom loop and its ``Trainer.fit`` block, as written, under model parallelism: a tensor-parallel
mesh (dp=2,tp=2: the seed CNN's classifier split over 2 processes) and a pipeline (pp=2,dp=2: its layers in 2
stages), each on 4 processes, print the numbers one process prints (the losses of every epoch; the evaluation's
loss and accuracy after a fit with validation, which runs the pipeline forward without a schedule)."""

from __future__ import annotations

import json

import pytest

import towers
from doc_blocks import NUMBER, ROOT, python_blocks, run_block, run_block_here

pytestmark = pytest.mark.timeout(420)

_README = python_blocks(ROOT / "README.md")
LOOP = next(b for b in _README if "strategy.forward_backward(model, x, y, loss_fn)" in b.code)
FIT = next(b for b in python_blocks(ROOT / "docs" / "getting_started.md") if "trainer.fit(train_set" in b.code)


def _run_both(work_dir: str) -> str:
    return run_block(LOOP.name, LOOP.code, work_dir) + run_block(FIT.name, FIT.code, work_dir)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[list[float], list[str]]:
    assert towers.cluster.from_env().world_size == 1
    work = tmp_path_factory.mktemp("one")
    out = run_block_here(LOOP.name, LOOP.code, str(work)) + run_block_here(FIT.name, FIT.code, str(work))
    numbers = [float(v) for v in NUMBER.findall(out)]
    assert len(numbers) == 6, out  # three epochs' losses, then the evaluation's loss, accuracy and examples
    return numbers, _predictions(out)


def _predictions(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("tensor(")]  # predict's classes, then the labels


@pytest.mark.parametrize("mesh", ["dp=2,tp=2", "pp=2,dp=2"])
def test_the_readme_loop_and_fit_print_one_processs_numbers_on_a_mesh(mesh, one_process, tmp_path):
    outputs = towers.spawn(_run_both, 4, args=(str(tmp_path),), timeout_s=360, threads_per_process=1,
                           env={"TOWERS_STRATEGY": "sharded", "TOWERS_STRATEGY_OPTIONS": json.dumps({"mesh": mesh})})
    fit_lines = outputs[0].splitlines()[3:]  # the loop prints on the chief; the fit block on every process
    assert all(out.splitlines() == fit_lines for out in outputs[1:]), outputs  # every stage the last stage's numbers
    numbers, predictions = one_process
    assert [float(v) for v in NUMBER.findall(outputs[0])] == pytest.approx(numbers, rel=1e-4, abs=1e-5), outputs[0]
    assert _predictions(outputs[0]) == predictions and predictions, outputs[0]
