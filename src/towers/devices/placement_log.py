"""The placement log: ``towers.log_device_placement(True)`` logs each executed op and its device.

Lines look like ``aten::addmm -> /cpu:0`` and go to the ``towers.devices.placement`` logger at INFO, or to
stderr when no logging handler is configured (what TensorFlow does: a plain script sees them).
They come from a ``TorchDispatchMode`` that sees every ATen op after autograd, so backward ops are
logged too (``aten::mm``, ``aten::convolution_backward``...). The op's device is its first output
tensor's device (or its first input's, for an op with no tensor output).

Scope and cost:

* Off by default, and free when off: no mode is installed, so nothing runs per op.
* Torch keeps dispatch modes per thread: the log covers ops run by the thread that turned it on,
  plus the backward ops of graphs that thread runs (the autograd engine runs CPU backward on the
  calling thread and carries thread-local state to its GPU worker threads). Ops in other threads
  (e.g. ``DataLoader`` workers) are not logged.
* The mode stack is the state: there is no module-level flag, and ``get_log_device_placement()``
  looks for the mode on the current thread's stack.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from towers._logging import get_logger
from towers.devices.names import Device
from towers.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["PlacementRecord", "PlacementLog", "log_device_placement", "get_log_device_placement"]

placement_logger = get_logger("towers.devices.placement")


def _logging_configured(logger: logging.Logger) -> bool:
    """True when a handler other than a NullHandler would receive ``logger``'s records."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False

_NAMES: dict[torch.device, str] = {}


def _device_name(dev: torch.device) -> str:
    name = _NAMES.get(dev)
    if name is None:
        try:
            name = str(Device(dev))
        except ValueError:  # mps, xpu, ...: not a towers device, still worth logging
            name = f"/{dev}"
        _NAMES[dev] = name
    return name


def _first_device(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                return item.device
    return None


@dataclass(frozen=True)
class PlacementRecord:
    """One executed op and the device it ran on: ``str()`` gives ``aten::addmm -> /cpu:0``.

    Attributes:
        op: the op's name, e.g. ``aten::addmm``.
        device: the canonical name of the device it ran on, e.g. ``/cpu:0``.
    """

    op: str
    device: str

    def __str__(self) -> str:
        return f"{self.op} -> {self.device}"


class _PlacementLogMode(TorchDispatchMode):
    """Runs each op unchanged, then records ``op -> device``."""

    def __init__(self, records: list[PlacementRecord] | None, to_logger: bool) -> None:
        super().__init__()
        self.records = records
        self.to_logger = to_logger
        # As TensorFlow prints every op: with nobody listening to the logger, the lines go to stderr.
        self.to_stderr = to_logger and not _logging_configured(placement_logger)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        dev = _first_device(out)
        if dev is None:
            dev = _first_device(args)
        device_name = "?" if dev is None else _device_name(dev)
        op = func.name()
        if self.to_stderr:
            sys.stderr.write(f"{op} -> {device_name}\n")
        elif self.to_logger:
            placement_logger.info("%s -> %s", op, device_name)
        if self.records is not None:
            self.records.append(PlacementRecord(op, device_name))
        return out


def _find_mode() -> _PlacementLogMode | None:
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _PlacementLogMode):
            return mode
    return None


def _remove(mode: _PlacementLogMode) -> None:
    """Take ``mode`` off this thread's dispatch stack, keeping any modes pushed after it."""
    stack = _get_current_dispatch_mode_stack()
    if mode not in stack:
        return
    above = []
    while _get_current_dispatch_mode_stack()[-1] is not mode:
        above.append(_pop_mode())
    mode.__exit__(None, None, None)
    for other in reversed(above):
        _push_mode(other)


class PlacementLog:
    """Handle returned by ``log_device_placement``; as a context manager it restores the previous state.

    Args:
        enabled: whether the log is on.
        records: the list given to ``log_device_placement`` (``None`` when none was given).
        to_logger: whether each op is logged.
    """

    def __init__(self, enabled: bool, records: list[PlacementRecord] | None, to_logger: bool) -> None:
        self.enabled = enabled
        self.records = records
        self._previous = _find_mode()
        if self._previous is not None:
            _remove(self._previous)
        self._mode = _PlacementLogMode(records, to_logger) if enabled else None
        if self._mode is not None:
            self._mode.__enter__()

    def __enter__(self) -> PlacementLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._mode is not None:
            _remove(self._mode)
        if self._previous is not None and _find_mode() is None:
            self._previous.__enter__()


def log_device_placement(
    enabled: bool = True,
    *,
    records: list[PlacementRecord] | None = None,
    to_logger: bool = True,
) -> PlacementLog:
    """Turn the placement log on or off for this thread; also a context manager that restores on exit.

    ``towers.log_device_placement(True)`` logs every op this thread runs from now on as
    ``aten::addmm -> /cpu:0`` (logger ``towers.devices.placement``, INFO);
    ``log_device_placement(False)`` stops it. ``with towers.log_device_placement():`` logs
    inside the block only.

    Args:
        enabled: True logs every op this thread runs from now on; False stops it.
        records: also collect each ``PlacementRecord`` in this list.
        to_logger: False collects without logging.

    Returns:
        A handle; as a context manager (``with towers.log_device_placement():``) it logs inside the block only.

    Example:
        ```python
        import torch
        import towers

        records = []
        with towers.log_device_placement(records=records, to_logger=False):
            torch.ones(2) + 1
        assert records and records[0].device == "/cpu:0"
        ```
    """
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"log_device_placement expects True or False. Received: {enabled!r}.")
    if not enabled and records is not None:
        raise InvalidArgumentError("log_device_placement(False) collects nothing; drop records= or pass True.")
    return PlacementLog(enabled, records, to_logger)


def get_log_device_placement() -> bool:
    """Return whether the placement log is on for this thread.

    Returns:
        True after ``log_device_placement(True)`` on this thread (or inside its ``with`` block).
    """
    return _find_mode() is not None
