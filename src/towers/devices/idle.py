"""Idle-GPU check (invariant 7): a job that leaves visible GPUs idle says so at start-up.

``check_idle_gpus`` is pure (pass ``visible_gpus`` to test it without a GPU); strategies call
``warn_if_gpus_idle`` at construction, which logs the message once per process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from towers._logging import get_logger
from towers.devices.listing import gpu_count
from towers.devices.names import Device, DeviceLike
from towers.errors import InvalidArgumentError

__all__ = ["check_idle_gpus", "warn_if_gpus_idle"]

logger = get_logger(__name__)

# Messages already logged by this process. Keyed by text, so a second strategy with the same
# layout stays quiet while a different layout still speaks.
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def check_idle_gpus(
    num_local_replicas: int,
    used_devices: Iterable[DeviceLike],
    visible_gpus: int | None = None,
) -> str | None:
    """Return a warning when this host's replicas leave visible GPUs idle, else None.

    Args:
        num_local_replicas: how many replicas (processes) the job runs on this host.
        used_devices: the devices they use: all of them, or just this process's (with one replica per GPU, a
            GPU job uses ``max(num_local_replicas, distinct GPUs listed)`` GPUs).
        visible_gpus: the GPUs this host shows. Default: ``torch.cuda.device_count()``.

    Returns:
        The warning's text, naming the idle GPUs and how to use them; None when none is idle.

    Raises:
        ValueError: ``num_local_replicas`` < 1, ``visible_gpus`` < 0, no used device, or a bad device name.
    """
    if not isinstance(num_local_replicas, int) or num_local_replicas < 1:
        raise InvalidArgumentError(
            f"num_local_replicas must be an integer >= 1. Received: {num_local_replicas!r}. "
            "Pass the number of replicas this host runs.")
    if visible_gpus is None:
        visible_gpus = gpu_count()
    if not isinstance(visible_gpus, int) or visible_gpus < 0:
        raise InvalidArgumentError(
            f"visible_gpus must be an integer >= 0. Received: {visible_gpus!r}. "
            "Pass torch.cuda.device_count(), or leave it out.")
    used = sorted({Device(d) for d in used_devices})
    if not used:
        raise InvalidArgumentError(
            "used_devices must name at least one device. Received none. "
            "Pass the devices this host's replicas run on, e.g. ['/gpu:0'].")
    if visible_gpus == 0:
        return None
    names = ", ".join(str(d) for d in used)
    visible = _plural(visible_gpus, "GPU is", "GPUs are")
    gpus_used = sum(1 for d in used if d.is_gpu and d.index < visible_gpus)
    if gpus_used == 0:
        idle = "it sits idle" if visible_gpus == 1 else f"all {visible_gpus} sit idle"
        return (
            f"{visible} visible but this job runs {_plural(num_local_replicas, 'replica', 'replicas')} "
            f"on CPU only ({names}): {idle}. Use OneDeviceStrategy('/gpu:0') for one GPU, or run "
            f"`towers launch --nproc-per-node {visible_gpus} ...` or MirroredStrategy() to use them all.")
    gpus_used = max(gpus_used, num_local_replicas)
    if gpus_used >= visible_gpus:
        return None
    idle_count = visible_gpus - gpus_used
    return (
        f"{visible} visible but this job uses {gpus_used} ({names}): "
        f"{_plural(idle_count, 'sits', 'sit')} idle. Run `towers launch --nproc-per-node {visible_gpus} ...` "
        "or MirroredStrategy() to use them all.")


def warn_if_gpus_idle(
    num_local_replicas: int,
    used_devices: Iterable[DeviceLike],
    *,
    visible_gpus: int | None = None,
    local_rank: int = 0,
) -> str | None:
    """Log ``check_idle_gpus``'s warning once per process; return it when logged now, else None.

    Only ``local_rank`` 0 logs: the message is about the host, so one line per host is enough.

    Args:
        num_local_replicas: as ``check_idle_gpus`` takes it.
        used_devices: as ``check_idle_gpus`` takes it.
        visible_gpus: as ``check_idle_gpus`` takes it.
        local_rank: this process's rank on its host; only 0 logs.

    Returns:
        The warning when this call logged it; None otherwise.
    """
    if local_rank != 0:
        return None
    message = check_idle_gpus(num_local_replicas, used_devices, visible_gpus)
    if message is None:
        return None
    with _warned_lock:
        if message in _warned:
            return None
        _warned.add(message)
    logger.warning(message)
    return message
