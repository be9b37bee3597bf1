"""The placement log: ``aten::addmm -> /cpu:0`` for each executed op, off by default, scoped."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

import towers
from towers.devices import PlacementRecord, get_log_device_placement, log_device_placement


@pytest.fixture
def placement_lines():
    """Messages logged on ``towers.devices.placement``."""
    lines: list[str] = []

    class _ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "towers.devices.placement" and record.levelno == logging.INFO:
                lines.append(record.getMessage())

    handler = _ListHandler()
    logger = logging.getLogger("towers")
    level = logger.level
    logger.setLevel(logging.INFO)  # INFO must pass whatever tests ran before (alone, the effective level is WARNING)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_plain_script_sees_the_lines_on_stderr():
    import subprocess
    import sys

    code = "import torch, towers\ntowers.log_device_placement(True)\ntorch.ones(2) + 1\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "aten::add.Tensor -> /cpu:0" in done.stderr.splitlines()  # as TensorFlow prints every op
    configured = "import logging, torch, towers\nlogging.basicConfig(level=logging.INFO, format='LOG %(message)s')\n" \
                 "towers.log_device_placement(True)\ntorch.ones(2) + 1\n"
    done = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True, timeout=120)
    assert "LOG aten::add.Tensor -> /cpu:0" in done.stderr.splitlines()  # logging configured: through logging


def _linear_forward() -> torch.Tensor:
    torch.manual_seed(0)
    layer = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    return layer(x)


def test_off_by_default_and_nothing_installed():
    assert get_log_device_placement() is False
    assert _get_current_dispatch_mode_stack() == []


def test_linear_forward_logs_addmm_on_cpu(placement_lines):
    records: list[PlacementRecord] = []
    with towers.log_device_placement(records=records) as log:
        assert get_log_device_placement() is True
        _linear_forward()
    assert log.records is records
    assert PlacementRecord("aten::addmm", "/cpu:0") in records
    assert "aten::addmm -> /cpu:0" in [str(r) for r in records]
    assert "aten::addmm -> /cpu:0" in placement_lines
    assert len(placement_lines) == len(records)


def test_nothing_is_logged_when_off(placement_lines):
    _linear_forward()
    assert placement_lines == []


def test_context_manager_restores_off():
    records: list[PlacementRecord] = []
    with log_device_placement(records=records, to_logger=False):
        torch.ones(1) + 1
    assert get_log_device_placement() is False
    assert _get_current_dispatch_mode_stack() == []
    count = len(records)
    assert count >= 2
    torch.ones(1) + 1
    assert len(records) == count


def test_enable_and_disable_as_calls(placement_lines):
    log_device_placement(True)
    try:
        assert get_log_device_placement() is True
        torch.ones(2).sum()
    finally:
        log_device_placement(False)
    assert get_log_device_placement() is False
    assert "aten::sum -> /cpu:0" in placement_lines
    seen = len(placement_lines)
    torch.ones(2).sum()
    assert len(placement_lines) == seen


def test_disabled_block_inside_enabled_block_restores_logging():
    outer: list[PlacementRecord] = []
    with log_device_placement(records=outer, to_logger=False):
        with log_device_placement(False):
            assert get_log_device_placement() is False
            torch.zeros(1).neg()
        assert get_log_device_placement() is True
        torch.zeros(1).exp()
    ops = [r.op for r in outer]
    assert "aten::neg" not in ops
    assert "aten::exp" in ops
    assert get_log_device_placement() is False


def test_backward_ops_are_logged():
    records: list[PlacementRecord] = []
    with log_device_placement(records=records, to_logger=False):
        _linear_forward().sum().backward()
    ops = [r.op for r in records]
    # forward uses addmm; mm appears only in the backward of the linear layer
    assert "aten::addmm" in ops and "aten::mm" in ops
    assert all(r.device == "/cpu:0" for r in records)


def test_device_is_named_canonically_for_meta_tensors():
    records: list[PlacementRecord] = []
    with towers.device("meta"), log_device_placement(records=records, to_logger=False):
        nn.Linear(2, 2)(torch.randn(3, 2))
    assert PlacementRecord("aten::addmm", "/meta:0") in records


def test_ops_in_other_threads_are_not_logged():
    records: list[PlacementRecord] = []
    with log_device_placement(records=records, to_logger=False):
        worker = threading.Thread(target=lambda: torch.ones(1).tanh())
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive()
    assert "aten::tanh" not in [r.op for r in records]


class _CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_disable_keeps_a_mode_pushed_after_it():
    log_device_placement(True, to_logger=False)
    other = _CountingMode()
    other.__enter__()
    try:
        log_device_placement(False)
        assert get_log_device_placement() is False
        assert _get_current_dispatch_mode_stack() == [other]
        torch.ones(1) + 1
        assert other.count >= 1
    finally:
        other.__exit__(None, None, None)
        log_device_placement(False)
    assert _get_current_dispatch_mode_stack() == []


def test_record_str_and_argument_checks():
    assert str(PlacementRecord("aten::addmm", "/gpu:0")) == "aten::addmm -> /gpu:0"
    with pytest.raises(TypeError, match="Received: 'yes'"):
        log_device_placement("yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="collects nothing"):
        log_device_placement(False, records=[])
    assert get_log_device_placement() is False
