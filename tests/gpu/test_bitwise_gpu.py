"""bitwise=True on cuda: deterministic kernels on, cuBLAS's fixed workspace, and two runs of the seed CNN with Adam
with the same bits in one process. (Several replicas need a GPU each: the multi-GPU tier's job.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import towers
from towers.cluster.info import ProcessInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bitwise_job import train  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
    pytest.mark.timeout(300),
]


def _cuda_strategy() -> towers.Strategy:
    return towers.OneDeviceStrategy("cuda:0", info=ProcessInfo(), bitwise=True, micro_batch_size=4)


def test_bitwise_on_cuda_turns_on_deterministic_kernels_and_repeats_its_bits():
    first = train(10, strategy=_cuda_strategy())
    assert torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    second = train(10, strategy=_cuda_strategy())
    assert first["losses"] == second["losses"]
    assert all(torch.equal(first["params"][k], v) for k, v in second["params"].items())
    assert next(iter(first["params"].values())).device.type == "cuda"

