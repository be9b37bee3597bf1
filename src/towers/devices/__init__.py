"""Devices and placement: names, listing, the ``device()`` scope, soft placement, the placement log, idle GPUs.

* ``names``: ``Device`` parses every spelling (``gpu:1``, ``/device:GPU:1``, ``cuda:1``, ...) to one value.
* ``listing``: ``list_devices()`` and the report behind ``towers devices``.
* ``scope``: ``with device(name):``, soft placement (``set_soft_device_placement``), ``resolve_device``.
* ``placement_log``: ``log_device_placement()``: ``aten::addmm -> /cpu:0`` for each executed op.
* ``idle``: ``check_idle_gpus`` / ``warn_if_gpus_idle``: say so when visible GPUs sit idle.
"""

from __future__ import annotations

from towers.devices.idle import check_idle_gpus, warn_if_gpus_idle
from towers.devices.listing import describe_devices, format_devices, gpu_count, is_available, list_devices
from towers.devices.names import ACCEPTED_FORMS, Device, DeviceLike
from towers.devices.placement_log import (
    PlacementLog,
    PlacementRecord,
    get_log_device_placement,
    log_device_placement,
)
from towers.devices.scope import (
    DeviceUnavailableError,
    SoftPlacementWarning,
    device,
    get_soft_device_placement,
    place,
    resolve_device,
    set_soft_device_placement,
)

__all__ = [
    "ACCEPTED_FORMS",
    "Device",
    "DeviceLike",
    "DeviceUnavailableError",
    "PlacementLog",
    "PlacementRecord",
    "SoftPlacementWarning",
    "check_idle_gpus",
    "describe_devices",
    "device",
    "format_devices",
    "get_log_device_placement",
    "get_soft_device_placement",
    "gpu_count",
    "is_available",
    "list_devices",
    "log_device_placement",
    "place",
    "resolve_device",
    "set_soft_device_placement",
    "warn_if_gpus_idle",
]
