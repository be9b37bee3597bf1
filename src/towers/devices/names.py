"""Device names: ``Device`` parses every spelling users bring to one canonical value.

Accepted spellings (device kinds are case-insensitive)::

    cpu   /cpu:0   /device:CPU:0
    gpu   gpu:1    GPU:1   /gpu:1   /device:GPU:1   cuda   cuda:1
    meta                                 (torch's storage-less device, for shape-only construction)
    /job:worker/replica:0/task:1/device:GPU:0        (tf.distribute's full form)
    torch.device("cuda", 1), or another Device

A name without an index means index 0 (``gpu`` is ``/gpu:0``), not "the current CUDA device":
a ``Device`` is a value, and must not change meaning with process state.

The ``/job:…/replica:…/task:…`` prefix is accepted and kept (``job``, ``replica``, ``task``), but
it is *metadata*: equality, hashing and ordering use only the device part (kind and index).
Every towers process places tensors on its own local devices, so ``/job:worker/task:1/gpu:0``
and ``/gpu:0`` name the same place when resolved in a process; ``full_name`` keeps the prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

import torch

from towers.errors import InvalidArgumentError

__all__ = ["Device", "DeviceLike", "ACCEPTED_FORMS"]

#: What ``Device`` accepts; quoted by every parse error.
ACCEPTED_FORMS = (
    "'cpu', '/cpu:0', 'gpu', 'gpu:1', 'GPU:1', '/gpu:1', '/device:GPU:1', 'cuda', 'cuda:1', 'meta', "
    "'/job:worker/replica:0/task:1/device:GPU:0', a torch.device, or a towers.Device "
    "(kinds are case-insensitive; an index is a non-negative integer and defaults to 0)"
)

# Spelling -> canonical kind. "cuda" is torch's name for what tf (and towers) call a GPU.
_KINDS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "meta": "meta"}
# Canonical kind -> torch.device type.
_TORCH_TYPES = {"cpu": "cpu", "gpu": "cuda", "meta": "meta"}
# Kinds with exactly one device in a process.
_SINGLE = ("cpu", "meta")

_INDEX = re.compile(r"[0-9]+\Z")
_JOB = re.compile(r"[A-Za-z0-9_.\-]+\Z")

DeviceLike = Union[str, torch.device, "Device"]


class _ParseError(Exception):
    """Internal: why a name failed to parse (turned into one ValueError by ``_parse``)."""


@dataclass(frozen=True, order=True, init=False, repr=False)
class Device:
    """A local device: ``kind`` (``"cpu"``, ``"gpu"`` or ``"meta"``) and ``index``.

    Build one from any accepted spelling: ``Device("cuda:1") == Device("/device:GPU:1")``.
    ``str()`` is the canonical name (``/gpu:1``); ``.torch`` is the ``torch.device``.

    Args:
        spec: a device name in any accepted spelling (``"cpu"``, ``"cuda:1"``, ``"/gpu:1"``,
            ``"/device:GPU:1"``, ``"/job:worker/replica:0/task:0/device:GPU:1"``, ``"meta"``), a
            ``torch.device`` or another ``Device``.

    Raises:
        ValueError: the name is not one of the accepted forms (the message lists them).
    """

    kind: str
    index: int
    job: str | None = field(default=None, compare=False)
    replica: int | None = field(default=None, compare=False)
    task: int | None = field(default=None, compare=False)

    def __init__(self, spec: DeviceLike, /) -> None:
        kind, index, job, replica, task = _parse(spec)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "job", job)
        object.__setattr__(self, "replica", replica)
        object.__setattr__(self, "task", task)

    @property
    def name(self) -> str:
        """The canonical local name, e.g. ``/gpu:1`` or ``/cpu:0``."""
        return f"/{self.kind}:{self.index}"

    @property
    def full_name(self) -> str:
        """The canonical name with the job/replica/task prefix when one was given."""
        prefix = ""
        if self.job is not None:
            prefix += f"/job:{self.job}"
        if self.replica is not None:
            prefix += f"/replica:{self.replica}"
        if self.task is not None:
            prefix += f"/task:{self.task}"
        return prefix + self.name

    @property
    def torch(self) -> torch.device:
        """The ``torch.device`` for this device (``cuda:1``, ``cpu``, ``meta``)."""
        if self.kind in _SINGLE:
            return torch.device(_TORCH_TYPES[self.kind])
        return torch.device(_TORCH_TYPES[self.kind], self.index)

    @property
    def is_gpu(self) -> bool:
        """True for a CUDA device."""
        return self.kind == "gpu"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Device({self.full_name!r})"


def _parse(spec: object) -> tuple[str, int, str | None, int | None, int | None]:
    """Return ``(kind, index, job, replica, task)`` for ``spec``, or raise one ValueError."""
    if isinstance(spec, Device):
        return spec.kind, spec.index, spec.job, spec.replica, spec.task
    try:
        if isinstance(spec, torch.device):
            kind, index = _from_torch(spec)
            return kind, index, None, None, None
        if isinstance(spec, str):
            return _from_string(spec)
        raise _ParseError(f"expected a str, torch.device or towers.Device, got {type(spec).__name__}")
    except _ParseError as err:
        raise InvalidArgumentError(
            f"Invalid device name {spec!r}: {err}. Received: {spec!r}. Accepted forms: {ACCEPTED_FORMS}."
        ) from None


def _from_torch(dev: torch.device) -> tuple[str, int]:
    if dev.type not in ("cpu", "cuda", "meta"):
        raise _ParseError(f"towers places on cpu, cuda (gpu) and meta devices, not {dev.type!r}")
    kind = _KINDS[dev.type]
    return kind, _check_index(kind, 0 if dev.index is None else dev.index)


def _from_string(text: str) -> tuple[str, int, str | None, int | None, int | None]:
    text = text.strip()
    if not text:
        raise _ParseError("the name is empty")
    parts = text[1:].split("/") if text.startswith("/") else text.split("/")
    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device: tuple[str, int] | None = None
    for part in parts:
        key, _, value = part.partition(":")
        key = key.lower()
        if not part:
            raise _ParseError("it has an empty component (a doubled or trailing '/')")
        if device is not None:
            raise _ParseError(f"nothing may follow the device, found {part!r}")
        if key == "job":
            if job is not None or not _JOB.match(value):
                raise _ParseError(f"{part!r} must appear once, with letters, digits, '_', '-' or '.'")
            job = value
        elif key in ("replica", "task"):
            if (replica if key == "replica" else task) is not None or not _INDEX.match(value):
                raise _ParseError(f"{part!r} must appear once, with a non-negative integer")
            if key == "replica":
                replica = int(value)
            else:
                task = int(value)
        else:
            device = _device_part(value if key == "device" else part)
    if device is None:
        raise _ParseError("it names no device (add e.g. '/device:GPU:0')")
    return device[0], device[1], job, replica, task


def _device_part(text: str) -> tuple[str, int]:
    """Parse ``KIND`` or ``KIND:INDEX`` (``GPU:1``, ``cuda``, ``cpu:0``)."""
    kind_text, sep, index_text = text.partition(":")
    kind = _KINDS.get(kind_text.lower())
    if kind is None:
        raise _ParseError(f"unknown device kind {kind_text!r} (towers knows cpu, gpu/cuda and meta)")
    if not sep:
        return kind, 0
    if not _INDEX.match(index_text):
        raise _ParseError(f"the index {index_text!r} must be a non-negative integer")
    return kind, _check_index(kind, int(index_text))


def _check_index(kind: str, index: int) -> int:
    if index < 0:
        raise _ParseError(f"the index {index} must be a non-negative integer")
    if kind in _SINGLE and index != 0:
        raise _ParseError(f"a process has one {kind} device, /{kind}:0")
    return index
