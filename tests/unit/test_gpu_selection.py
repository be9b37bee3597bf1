"""The choices made for GPUs, on any machine: NCCL or Gloo, and which device a replica takes, with a faked GPU count.

torch.cuda is faked (``is_available``/``device_count``), so these run, and must pass, on a CPU-only
machine; the GPU tier (``make gpu-check``) runs them beside tests/gpu. Nothing here touches CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import towers
from towers.bench.workloads import replica_device
from towers.cluster.info import ProcessInfo
from towers.devices import gpu_count, list_devices
from towers.process_group import choose_backend


@pytest.fixture
def fake_gpus(monkeypatch):
    """Make torch report ``n`` CUDA devices (0: no CUDA at all), and NCCL built; returns the setter."""

    def fake(n: int, *, nccl: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)

    return fake


# (processes on this host, GPUs visible) -> backend: NCCL only when every local replica has a GPU of its own
CASES = [(1, 0, "gloo"), (1, 1, "nccl"), (2, 1, "gloo"), (2, 2, "nccl"), (4, 2, "gloo"), (2, 8, "nccl"),
         (8, 8, "nccl")]


@pytest.mark.parametrize("local_world_size, gpus, backend", CASES)
def test_nccl_or_gloo_follows_the_visible_gpu_count(fake_gpus, local_world_size, gpus, backend):
    fake_gpus(gpus)
    assert gpu_count() == gpus
    assert choose_backend(local_world_size) == backend  # the count read from torch, as init_process_group does


def test_gloo_when_torch_has_no_nccl_even_with_a_gpu_per_replica(fake_gpus):
    fake_gpus(2, nccl=False)
    assert choose_backend(2) == "gloo"


def test_cuda_available_with_no_device_counts_as_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a stale count without a usable driver
    assert gpu_count() == 0 and choose_backend(1) == "gloo"
    assert list_devices() == [towers.Device("cpu")]


@pytest.mark.parametrize("local_world_size, gpus, backend", CASES)
def test_a_benchmark_replica_computes_where_the_backend_expects_it(fake_gpus, local_world_size, gpus, backend):
    # NCCL needs every rank on a GPU of its own; Gloo replicas stay on the CPU (never two NCCL ranks on one GPU).
    fake_gpus(gpus)
    devices = [replica_device(rank, local_world_size) for rank in range(local_world_size)]
    if backend == "nccl":
        assert devices == [torch.device("cuda", r) for r in range(local_world_size)]
    else:
        assert devices == [torch.device("cpu")] * local_world_size


@pytest.mark.parametrize("gpus, expected", [(0, "cpu"), (1, "cuda:0"), (2, "cuda:0")])
def test_one_device_strategy_defaults_to_the_first_gpu(fake_gpus, gpus, expected):
    fake_gpus(gpus)
    assert towers.OneDeviceStrategy(info=ProcessInfo()).device == torch.device(expected)


def test_a_gpu_past_the_visible_ones_is_placed_on_the_cpu_softly(fake_gpus):
    fake_gpus(1)  # /gpu:1 on a one-GPU machine
    assert towers.devices.is_available("/gpu:0") and not towers.devices.is_available("/gpu:1")
    with pytest.warns(towers.devices.SoftPlacementWarning, match="Device /gpu:1 is not available"):
        assert towers.devices.resolve_device("/gpu:1", soft=True) == torch.device("cpu")
    assert towers.devices.resolve_device("/gpu:0", soft=False) == torch.device("cuda", 0)
