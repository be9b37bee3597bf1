"""Device names, listing, the device() scope, soft placement and the idle-GPU check."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
import warnings

import pytest
import torch
from torch import nn

import towers
from towers.devices import (
    ACCEPTED_FORMS,
    Device,
    DeviceUnavailableError,
    SoftPlacementWarning,
    check_idle_gpus,
    is_available,
    list_devices,
    resolve_device,
    warn_if_gpus_idle,
)

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
MISSING_GPU = f"/gpu:{NUM_GPUS + 3}"  # /gpu:3 on this CPU host; never a real device


@pytest.fixture
def towers_records():
    """Collect records of the ``towers`` logger (it does not propagate to root, so caplog misses them)."""
    records: list[logging.LogRecord] = []

    class _ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _ListHandler(level=logging.DEBUG)
    logger = logging.getLogger("towers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# --- names --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "kind", "index"),
    [
        ("cpu", "cpu", 0),
        ("/cpu:0", "cpu", 0),
        ("CPU", "cpu", 0),
        ("/device:CPU:0", "cpu", 0),
        ("gpu", "gpu", 0),
        ("gpu:1", "gpu", 1),
        ("GPU:1", "gpu", 1),
        ("/gpu:1", "gpu", 1),
        ("/device:GPU:1", "gpu", 1),
        ("cuda", "gpu", 0),
        ("cuda:1", "gpu", 1),
        ("  cuda:12 ", "gpu", 12),
        ("meta", "meta", 0),
        ("/job:worker/replica:0/task:1/device:GPU:0", "gpu", 0),
        ("/job:localhost/replica:0/task:0/device:CPU:0", "cpu", 0),
        ("/job:ps/task:2/gpu:3", "gpu", 3),
        (torch.device("cuda", 1), "gpu", 1),
        (torch.device("cuda"), "gpu", 0),
        (torch.device("cpu"), "cpu", 0),
        (torch.device("meta"), "meta", 0),
    ],
)
def test_every_accepted_form_parses(spec, kind, index):
    dev = Device(spec)
    assert (dev.kind, dev.index) == (kind, index)
    assert Device(dev) == dev  # a Device is accepted too


def test_equal_names_compare_and_hash_equal():
    spellings = ["gpu:1", "GPU:1", "/gpu:1", "/device:GPU:1", "cuda:1", torch.device("cuda:1"),
                 "/job:worker/replica:0/task:1/device:GPU:1"]
    devices = [Device(s) for s in spellings]
    assert all(d == devices[0] for d in devices)
    assert len(set(devices)) == 1
    assert Device("gpu:1") != Device("gpu:0")
    assert Device("gpu:0") != Device("cpu")
    assert Device("cpu") != "cpu"  # only Devices compare equal to Devices
    assert sorted([Device("gpu:1"), Device("cpu"), Device("gpu:0")]) == [
        Device("cpu"), Device("gpu:0"), Device("gpu:1")]


def test_canonical_str_and_torch_device():
    assert str(Device("/device:GPU:1")) == "/gpu:1"
    assert str(Device("cpu")) == "/cpu:0"
    assert str(Device("meta")) == "/meta:0"
    assert Device("gpu:1").torch == torch.device("cuda", 1)
    assert Device("cuda").torch == torch.device("cuda", 0)
    assert Device("/cpu:0").torch == torch.device("cpu")
    assert Device("meta").torch == torch.device("meta")


def test_job_prefix_is_kept_but_does_not_change_identity():
    dev = Device("/job:worker/replica:0/task:1/device:GPU:0")
    assert (dev.job, dev.replica, dev.task) == ("worker", 0, 1)
    assert dev == Device("/gpu:0") and hash(dev) == hash(Device("/gpu:0"))
    assert str(dev) == "/gpu:0"
    assert dev.full_name == "/job:worker/replica:0/task:1/gpu:0"
    assert Device("gpu:0").job is None and Device("gpu:0").full_name == "/gpu:0"
    again = eval(repr(dev), {"Device": Device})  # repr round-trips, prefix included
    assert again == dev and again.full_name == dev.full_name


def test_device_is_frozen_and_picklable():
    dev = Device("/job:worker/task:1/gpu:2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        dev.index = 3  # type: ignore[misc]
    for clone in (pickle.loads(pickle.dumps(dev)), copy.deepcopy(dev)):
        assert clone == dev and clone.full_name == dev.full_name


@pytest.mark.parametrize(
    "bad",
    ["gpu:-1", "tpu:0", "gpu:x", "", "   ", None, "gpu:", "cpu:1", "meta:1", "/job:worker/task:1",
     "//gpu:0", "gpu:0/", "gpu:0/gpu:1", "/task:x/gpu:0", "/device:TPU:0", "gpu:1.5", 3,
     torch.device("cpu", 1)],
)
def test_bad_names_raise_value_error_quoting_input_and_forms(bad):
    with pytest.raises(ValueError) as info:
        Device(bad)
    message = str(info.value)
    assert f"Received: {bad!r}" in message
    assert ACCEPTED_FORMS in message
    assert "'/device:GPU:1'" in message and "'cuda:1'" in message


def test_unknown_kind_is_named_in_the_error():
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        Device("tpu:0")


# --- listing ------------------------------------------------------------------------------------
def test_list_devices_lists_cpu_then_each_visible_gpu():
    devices = list_devices()
    assert devices == [Device("cpu")] + [Device(f"gpu:{i}") for i in range(NUM_GPUS)]
    assert all(is_available(d) for d in devices)
    assert not is_available(MISSING_GPU)
    assert is_available("meta")


def test_towers_exports_the_device_api():
    assert towers.Device is Device
    assert towers.list_devices is list_devices
    assert towers.device is towers.devices.device


# --- soft placement -----------------------------------------------------------------------------
def test_soft_placement_is_on_by_default():
    assert towers.get_soft_device_placement() is True


def test_missing_device_falls_back_to_cpu_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with towers.device(MISSING_GPU) as used:
            a = torch.randn(2)
            b = nn.Linear(2, 2)
    assert used == Device("cpu")
    assert a.device.type == "cpu" and b.weight.device.type == "cpu"
    assert len(caught) == 1
    assert issubclass(caught[0].category, SoftPlacementWarning)
    text = str(caught[0].message)
    assert MISSING_GPU in text and "/cpu:0" in text
    assert caught[0].filename == __file__  # points at the `with` line, not inside towers


def test_repeated_fallback_at_one_line_warns_once_under_default_filters():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            with towers.device(MISSING_GPU):
                torch.randn(2)
    assert len(caught) == 1


def test_resolve_device_returns_torch_device_with_fallback():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta")
    with pytest.warns(SoftPlacementWarning, match=MISSING_GPU) as caught:
        assert resolve_device(MISSING_GPU) == torch.device("cpu")
    assert caught[0].filename == __file__


def test_hard_placement_raises_listing_available_devices():
    towers.set_soft_device_placement(False)
    try:
        assert towers.get_soft_device_placement() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no warning on the way
            with pytest.raises(DeviceUnavailableError) as info:
                towers.device(MISSING_GPU)
    finally:
        towers.set_soft_device_placement(True)
    message = str(info.value)
    assert MISSING_GPU in message
    assert "Available devices: " + ", ".join(str(d) for d in list_devices()) in message
    assert "set_soft_device_placement(True)" in message
    assert isinstance(info.value, ValueError)


def test_soft_argument_overrides_the_global_setting():
    with pytest.raises(DeviceUnavailableError):
        resolve_device(MISSING_GPU, soft=False)
    assert towers.get_soft_device_placement() is True


def test_set_soft_device_placement_rejects_non_bool():
    with pytest.raises(TypeError, match="Received: 'no'"):
        towers.set_soft_device_placement("no")  # type: ignore[arg-type]


def test_bad_name_in_scope_raises_value_error():
    with pytest.raises(ValueError, match="Received: 'gpu:-1'"):
        towers.device("gpu:-1")


# --- scope --------------------------------------------------------------------------------------
def test_scope_puts_new_tensors_and_modules_on_the_device():
    with towers.device("meta") as used:
        x = torch.randn(2)
        layer = nn.Linear(2, 2)
        assert torch.get_default_device() == torch.device("meta")
    assert used == Device("meta")
    assert x.device.type == "meta"
    assert {p.device.type for p in layer.parameters()} == {"meta"}
    assert torch.randn(2).device.type == "cpu"  # restored


def test_cpu_scope_places_on_cpu():
    with towers.device("/cpu:0"):
        assert torch.get_default_device() == torch.device("cpu")
        assert torch.zeros(1).device.type == "cpu"
        assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_scopes_nest_and_restore():
    with towers.device("meta"):
        with towers.device("cpu"):
            assert torch.ones(1).device.type == "cpu"
            with towers.device("meta"):
                assert torch.ones(1).device.type == "meta"
            assert torch.ones(1).device.type == "cpu"
        assert torch.ones(1).device.type == "meta"
    assert torch.ones(1).device.type == "cpu"


def test_scope_restores_on_exception_and_can_be_reentered():
    scope = towers.device("meta")
    with pytest.raises(RuntimeError, match="boom"):
        with scope:
            raise RuntimeError("boom")
    assert torch.ones(1).device.type == "cpu"
    with scope:
        with scope:
            assert torch.ones(1).device.type == "meta"
        assert torch.ones(1).device.type == "meta"
    assert torch.ones(1).device.type == "cpu"


# --- idle GPUs ----------------------------------------------------------------------------------
def test_idle_check_one_of_four_gpus_used():
    message = check_idle_gpus(1, ["/gpu:0"], visible_gpus=4)
    assert message == (
        "4 GPUs are visible but this job uses 1 (/gpu:0): 3 sit idle. "
        "Run `towers launch --nproc-per-node 4 ...` or MirroredStrategy() to use them all.")


def test_idle_check_is_quiet_when_every_gpu_is_used():
    assert check_idle_gpus(2, ["/gpu:0", "/gpu:1"], visible_gpus=2) is None
    # each process may list only its own device: two local replicas still use both GPUs
    assert check_idle_gpus(2, ["cuda:1"], visible_gpus=2) is None


def test_idle_check_is_quiet_without_gpus():
    assert check_idle_gpus(1, ["cpu"], visible_gpus=0) is None
    assert check_idle_gpus(4, ["/gpu:0"], visible_gpus=0) is None


def test_idle_check_cpu_job_on_gpu_host():
    message = check_idle_gpus(2, ["cpu"], visible_gpus=2)
    assert message is not None
    assert message.startswith("2 GPUs are visible but this job runs 2 replicas on CPU only (/cpu:0): all 2 sit idle.")
    assert "--nproc-per-node 2" in message and "OneDeviceStrategy('/gpu:0')" in message


def test_idle_check_counts_local_replicas_and_says_one_sits_idle():
    message = check_idle_gpus(3, ["/gpu:2"], visible_gpus=4)
    assert message is not None and "uses 3 (/gpu:2): 1 sits idle" in message


def test_idle_check_validates_its_arguments():
    with pytest.raises(ValueError, match="num_local_replicas must be an integer >= 1. Received: 0"):
        check_idle_gpus(0, ["cpu"], visible_gpus=2)
    with pytest.raises(ValueError, match="visible_gpus must be an integer >= 0. Received: -1"):
        check_idle_gpus(1, ["cpu"], visible_gpus=-1)
    with pytest.raises(ValueError, match="used_devices must name at least one device"):
        check_idle_gpus(1, [], visible_gpus=2)
    with pytest.raises(ValueError, match="Received: 'tpu:0'"):
        check_idle_gpus(1, ["tpu:0"], visible_gpus=2)


def test_warn_if_gpus_idle_logs_once_per_process(towers_records):
    # 7 visible GPUs: a layout no other test uses, so this process has not logged it yet
    first = warn_if_gpus_idle(1, ["/gpu:0"], visible_gpus=7)
    second = warn_if_gpus_idle(1, ["/gpu:0"], visible_gpus=7)
    assert first == check_idle_gpus(1, ["/gpu:0"], visible_gpus=7)
    assert second is None
    warnings_logged = [r for r in towers_records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings_logged] == [first]
    assert warnings_logged[0].name == "towers.devices.idle"


def test_warn_if_gpus_idle_is_quiet_off_local_rank_zero_and_when_all_used(towers_records):
    assert warn_if_gpus_idle(1, ["/gpu:0"], visible_gpus=9, local_rank=1) is None
    assert warn_if_gpus_idle(2, ["/gpu:0"], visible_gpus=2) is None
    assert towers_records == []
