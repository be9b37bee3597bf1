"""The GPU path of towers.devices: placement scope, listing, placement log on cuda."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import towers
from towers.devices import Device, PlacementRecord, describe_devices, list_devices, log_device_placement

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
