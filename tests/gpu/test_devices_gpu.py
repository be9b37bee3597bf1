"""The GPU path of towers.devices: placement scope, listing, placement log, soft placement and the idle-GPU warning on cuda."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import towers
from towers.devices import (
    Device,
    DeviceUnavailableError,
    PlacementRecord,
    SoftPlacementWarning,
    describe_devices,
    list_devices,
    log_device_placement,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]


def test_gpus_are_listed_with_their_properties():
    count = torch.cuda.device_count()
    assert list_devices()[1:] == [Device(f"/gpu:{i}") for i in range(count)]
    gpus = describe_devices()["devices"][1:]
    assert len(gpus) == count
    props = torch.cuda.get_device_properties(0)
    assert gpus[0]["total_memory_bytes"] == props.total_memory
    assert props.name in gpus[0]["description"]


def test_scope_places_tensors_and_modules_on_gpu_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with towers.device("/gpu:0") as used:
            x = torch.randn(2)
            layer = nn.Linear(2, 2)
            assert torch.cuda.current_device() == 0
    assert used == Device("cuda:0")
    assert x.device == torch.device("cuda", 0)
    assert layer.weight.device == torch.device("cuda", 0)
    assert torch.randn(1).device.type == "cpu"


def test_last_gpu_is_current_inside_its_scope():
    last = torch.cuda.device_count() - 1
    before = torch.cuda.current_device()
    with towers.device(f"gpu:{last}"):
        assert torch.cuda.current_device() == last
        assert torch.ones(1).device == torch.device("cuda", last)
    assert torch.cuda.current_device() == before


def test_resolve_device_keeps_an_existing_gpu():
    assert towers.devices.resolve_device("/device:GPU:0", soft=False) == torch.device("cuda", 0)


def test_placement_log_names_the_gpu_including_backward():
    records: list[PlacementRecord] = []
    with towers.device("gpu:0"), log_device_placement(records=records, to_logger=False):
        nn.Linear(2, 2)(torch.randn(3, 2)).sum().backward()
    assert PlacementRecord("aten::addmm", "/gpu:0") in records
    assert PlacementRecord("aten::mm", "/gpu:0") in records


@pytest.fixture
def towers_records():
    """Collect records of the ``towers`` logger at INFO and above (it does not propagate to root, so caplog misses them)."""
    records: list[logging.LogRecord] = []

    class _ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _ListHandler(level=logging.INFO)
    logger = logging.getLogger("towers")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_placement_log_lines_say_gpu0(towers_records):
    with towers.device("/gpu:0"), log_device_placement(True):
        nn.Linear(4, 2)(torch.randn(3, 4)).relu().sum().backward()
    lines = [r.getMessage() for r in towers_records if r.name == "towers.devices.placement"]
    assert "aten::addmm -> /gpu:0" in lines
    assert "aten::relu -> /gpu:0" in lines
    assert not [line for line in lines if line.endswith("/cpu:0") and "addmm" in line]


def test_soft_placement_of_a_gpu_this_machine_lacks_falls_back_to_cpu_once():
    # /gpu:1 on a one-GPU machine: the first index past the last GPU, whatever the count.
    missing = f"/gpu:{torch.cuda.device_count()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with towers.device(missing, soft=True) as used:
            x = torch.ones(2)
        strategy = towers.OneDeviceStrategy(missing)
    assert used == Device("cpu") and x.device.type == "cpu"
    assert strategy.device == torch.device("cpu")
    soft = [w for w in caught if issubclass(w.category, SoftPlacementWarning)]
    assert len(soft) == 2, [str(w.message) for w in caught]  # one per placement, each naming the missing GPU
    assert all(f"Device {missing} is not available" in str(w.message) and "/gpu:0" in str(w.message) for w in soft)
    with pytest.raises(DeviceUnavailableError, match=f"Device {missing} is not available.*Available devices: /cpu:0, /gpu:0"):
        towers.device(missing, soft=False)


def test_idle_gpu_warning_names_the_idle_gpus(towers_records, monkeypatch):
    from towers.cluster.info import ProcessInfo
    from towers.devices import idle

    monkeypatch.setattr(idle, "_warned", set())  # once per process: earlier tests may have said it already
    count = torch.cuda.device_count()
    towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    warned = [r.getMessage() for r in towers_records if r.name == "towers.devices.idle" and r.levelno == logging.WARNING]
    gpus = "1 GPU is" if count == 1 else f"{count} GPUs are"
    idle_text = "it sits idle" if count == 1 else f"all {count} sit idle"
    assert warned == [f"{gpus} visible but this job runs 1 replica on CPU only (/cpu:0): {idle_text}. Use "
                      f"OneDeviceStrategy('/gpu:0') for one GPU, or run `towers launch --nproc-per-node {count} ...` "
                      "or MirroredStrategy() to use them all."]
    towers_records.clear()
    towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo())
    warned = [r.getMessage() for r in towers_records if r.name == "towers.devices.idle"]
    if count == 1:
        assert warned == []  # the only GPU is used: nothing to say
    else:
        assert len(warned) == 1 and f"this job uses 1 (/gpu:0): {count - 1}" in warned[0]
