"""Placement: ``resolve_device`` (soft placement rules) and the ``with towers.device(name):`` scope.

Soft placement state is one documented process-wide flag, like ``tf.config.set_soft_device_placement``:
it is read when a name is resolved, from any thread, so a setting made at the top of a script holds
in every thread that later resolves a device. (A context variable would silently not apply in
threads started before, or outside, the context that set it.) Calls that need a different rule pass
``soft=`` explicitly instead of flipping the global.

A fallback is reported with ``warnings.warn(SoftPlacementWarning)``, not the logger: it is a
warning about the caller's code, so Python's filters apply (``-W error::towers.devices.SoftPlacementWarning``
makes it fatal) and the default filter shows it once per call site and device pair.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from types import FrameType, TracebackType

import torch

from towers._logging import get_logger
from towers.devices.listing import is_available, list_devices
from towers.devices.names import Device, DeviceLike
from towers.errors import InvalidTypeError, TowersError

__all__ = [
    "SoftPlacementWarning",
    "DeviceUnavailableError",
    "set_soft_device_placement",
    "get_soft_device_placement",
    "place",
    "resolve_device",
    "device",
]

logger = get_logger(__name__)

_soft_placement = True  # process-wide; see the module docstring

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../towers/


def _stacklevel_outside_towers() -> int:
    """Return the ``warnings.warn`` stacklevel, from our caller, of the first frame outside towers."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


class SoftPlacementWarning(UserWarning):
    """A requested device does not exist here, and soft placement put the work on the CPU."""


class DeviceUnavailableError(TowersError, ValueError):
    """A requested device does not exist here and soft placement is off."""


def set_soft_device_placement(enabled: bool) -> None:
    """Turn soft placement on (a missing device falls back to ``/cpu:0``) or off (it raises).

    Args:
        enabled: True (the default state) or False.
    """
    global _soft_placement
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"set_soft_device_placement expects True or False. Received: {enabled!r}.")
    _soft_placement = enabled
    logger.debug("soft device placement %s", "on" if enabled else "off")


def get_soft_device_placement() -> bool:
    """Return whether soft placement is on (it is by default).

    Returns:
        True when a missing device falls back to ``/cpu:0``; False when it raises.
    """
    return _soft_placement


def place(spec: DeviceLike, *, soft: bool | None = None) -> Device:
    """Return the ``Device`` that work asked for on ``spec`` actually runs on.

    Args:
        spec: the device asked for.
        soft: fall back to ``/cpu:0`` when the device is missing. None: ``get_soft_device_placement()``.

    Returns:
        ``spec`` itself when it exists here; otherwise ``/cpu:0`` with one ``SoftPlacementWarning`` when
        soft placement is on. The warning points at the first caller outside towers (the user's ``with``
        line, or their strategy call).

    Raises:
        ValueError: ``spec`` is not a device name.
        DeviceUnavailableError: the device does not exist here and soft placement is off.
    """
    requested = Device(spec)
    if is_available(requested):
        return requested
    available = ", ".join(str(d) for d in list_devices())
    if not (_soft_placement if soft is None else soft):
        raise DeviceUnavailableError(
            f"Device {requested} is not available in this process. Available devices: {available}. "
            f"Received: {spec!r}. Pick an available device, or turn soft placement on "
            "(towers.set_soft_device_placement(True)) to fall back to /cpu:0.")
    fallback = Device("cpu")
    warnings.warn(
        f"Device {requested} is not available in this process (available: {available}); "
        f"placing on {fallback} instead (soft device placement). Ask for an available device, or call "
        "towers.set_soft_device_placement(False) to make this an error.",
        SoftPlacementWarning,
        stacklevel=_stacklevel_outside_towers(),
    )
    return fallback


def resolve_device(spec: DeviceLike, *, soft: bool | None = None) -> torch.device:
    """Return the ``torch.device`` to use for ``spec`` under the soft placement rules (see ``place``).

    Args:
        spec: the device asked for.
        soft: fall back to ``/cpu:0`` when the device is missing. None: ``get_soft_device_placement()``.

    Returns:
        The ``torch.device`` of ``place(spec, soft=soft)``.

    Raises:
        ValueError: ``spec`` is not a device name.
        DeviceUnavailableError: the device does not exist here and soft placement is off.
    """
    return place(spec, soft=soft).torch


class device:  # noqa: N801 - lower case, like torch.device and tf.device, because it is used as `with towers.device(...)`
    """Context manager: tensors and modules created inside land on ``spec`` (or on its soft fallback).

    ``with towers.device("/gpu:1"):`` makes torch factory functions (``torch.randn``, module
    parameters, ...) default to that device, through torch's own ``with torch.device(...)`` mode;
    on a GPU it also makes that GPU CUDA's current device. Scopes nest; leaving one restores the
    enclosing device. Like torch's, the scope belongs to the thread that enters it, and it moves
    no existing tensor: ``x + 1`` runs where ``x`` lives. ``as`` gives the ``Device`` used.

    The name is resolved when the scope is created, so a missing device warns (or, with
    ``soft=False`` / soft placement off, raises ``DeviceUnavailableError``) at the ``with`` line.
    A missing device falls back to ``/cpu:0``, not to an enclosing scope's device.

    Args:
        spec: the device, e.g. ``"/gpu:1"``, ``"cuda:1"`` or ``"cpu"``.
        soft: fall back to ``/cpu:0`` when the device is missing (with a warning); False raises. None:
            ``get_soft_device_placement()``.

    Example:
        ```python
        import torch
        import towers

        with towers.device("/cpu:0") as where:
            weights = torch.randn(3, 3)
        assert weights.device.type == "cpu" and str(where) == "/cpu:0"
        ```

    Raises:
        ValueError: ``spec`` is not a device name.
        DeviceUnavailableError: the device does not exist here and soft placement is off.
    """

    def __init__(self, spec: DeviceLike, *, soft: bool | None = None) -> None:
        self.device = place(spec, soft=soft)
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> Device:
        stack = contextlib.ExitStack()
        try:
            if self.device.is_gpu:
                stack.enter_context(torch.cuda.device(self.device.index))
            stack.enter_context(self.device.torch)
        except BaseException:
            stack.close()
            raise
        self._stacks.append(stack)  # a list, so one scope object can be re-entered while active
        return self.device

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stacks.pop().close()

    def __repr__(self) -> str:
        return f"towers.device({str(self.device)!r})"
