"""What this host has: ``list_devices()``, ``is_available()``, and the report behind ``towers devices``."""

from __future__ import annotations

import os
from typing import Any

import torch

from towers.devices.names import Device, DeviceLike

__all__ = ["gpu_count", "list_devices", "is_available", "describe_devices", "format_devices"]


def gpu_count() -> int:
    """Return how many CUDA devices this process sees (0 without CUDA).

    Returns:
        ``torch.cuda.device_count()`` where CUDA is available, else 0.
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def list_devices() -> list[Device]:
    """Return the devices this process can place on: ``[Device('/cpu:0'), Device('/gpu:0'), ...]``.

    GPUs are the CUDA devices torch sees (after ``CUDA_VISIBLE_DEVICES``). The storage-less
    ``meta`` device is always usable but is not listed: it is not hardware.

    Returns:
        The CPU first, then each visible GPU.
    """
    return [Device("cpu")] + [Device(f"gpu:{i}") for i in range(gpu_count())]


def is_available(spec: DeviceLike) -> bool:
    """Return True when ``spec`` names a device this process can place on now.

    Args:
        spec: a device name in any accepted spelling, or a ``torch.device``.

    Returns:
        False for a GPU this process does not see, or a name that is no device.
    """
    dev = Device(spec)
    if dev.kind in ("cpu", "meta"):
        return True
    return dev.index < gpu_count()


def _host_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # not POSIX, or the value is unknown
        return None


def _backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    found = {}
    for name in ("gloo", "nccl", "mpi", "ucc"):
        check = getattr(dist, f"is_{name}_available", None)
        if check is not None:
            found[name] = bool(check())
    return found


def describe_devices() -> dict[str, Any]:
    """Return a JSON-ready description of the torch build, the devices and the distributed backends.

    Returns:
        The report ``towers devices --json`` prints (``format_devices`` makes it a table).
    """
    devices: list[dict[str, Any]] = [{
        "name": "/cpu:0",
        "torch_device": "cpu",
        "kind": "cpu",
        "description": f"{os.cpu_count() or '?'} logical cores, torch uses {torch.get_num_threads()} threads",
        "total_memory_bytes": _host_memory_bytes(),
    }]
    for i in range(gpu_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({
            "name": f"/gpu:{i}",
            "torch_device": f"cuda:{i}",
            "kind": "gpu",
            "description": f"{props.name}, compute capability {props.major}.{props.minor}",
            "total_memory_bytes": int(props.total_memory),
        })
    import torch.distributed as dist

    return {
        "torch_version": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "devices": devices,
        "distributed_available": dist.is_available(),
        "distributed_backends": _backends(),
    }


def _gib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def format_devices(report: dict[str, Any]) -> str:
    """Return ``describe_devices()``'s report as the text table that ``towers devices`` prints.

    Args:
        report: what ``describe_devices()`` returned.

    Returns:
        The table, lines joined by newlines.
    """
    cuda = f"CUDA {report['cuda_version']}" if report["cuda_version"] else "CPU-only build"
    if report["cuda_version"] and not report["cuda_available"]:
        cuda += ", no GPU visible"
    rows = [("device", "torch", "memory", "description")]
    rows += [(d["name"], d["torch_device"], _gib(d["total_memory_bytes"]), d["description"])
             for d in report["devices"]]
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    lines = [f"torch {report['torch_version']} ({cuda})", ""]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    backends = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in report["distributed_backends"].items())
    if not report["distributed_available"]:
        backends = "none (torch.distributed is not available in this build)"
    lines += ["", f"distributed backends: {backends}"]
    return "\n".join(lines)
