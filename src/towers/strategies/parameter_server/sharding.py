"""Which ps task holds which parameter, and how a shard lies in one flat byte buffer.

Sharding is greedy by size: parameters are taken largest first and each goes to the ps task
holding the fewest bytes so far (ties: the lower task index). Every worker computes the same
assignment from the same model, so no assignment travels on the wire; the ps checks the
model's signature at registration instead.

A shard travels as one contiguous ``uint8`` buffer (one send per shard per message). Its
parameters are laid out grouped by dtype, each at a 64-byte-aligned offset, so a parameter is a
zero-copy view of the buffer and each dtype's region can be summed in one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from towers.errors import InvalidArgumentError

__all__ = ["SEGMENT_MIN_BYTES", "ParamSpec", "FlatLayout", "assign_shards", "model_signature", "signature_mismatch"]

_ALIGN_BYTES = 64
#: A gradient at least this large travels straight from ``p.grad`` as its own piece of a push (no copy).
SEGMENT_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class ParamSpec:
    """Name, shape and dtype of one parameter: what must match between workers and the ps."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * torch.empty((), dtype=_dtype(self.dtype)).element_size()

    def describe(self) -> str:
        """``'name' (shape) dtype`` for error messages."""
        return f"{self.name!r} {tuple(self.shape)} {self.dtype}"


def _dtype(name: str) -> torch.dtype:
    from towers.strategies.parameter_server.wire import DTYPES

    dtype = DTYPES.get(name.replace("torch.", ""))
    if dtype is None:
        raise InvalidArgumentError(f"parameters of dtype {name!r} cannot be held on a ps task; expected one of "
                                   f"{', '.join(DTYPES)}.")
    return dtype


def model_signature(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """Return the ``ParamSpec`` of every parameter, in the model's order."""
    return [ParamSpec(name, tuple(p.shape), str(p.dtype).replace("torch.", "")) for name, p in named_params]


def signature_mismatch(expected: Sequence[ParamSpec], received: Sequence[ParamSpec]) -> str | None:
    """Return a one-line description of the first difference between two signatures, or None when equal."""
    if list(expected) == list(received):
        return None
    if len(expected) != len(received):
        names_e, names_r = {s.name for s in expected}, {s.name for s in received}
        extra, missing = sorted(names_r - names_e)[:3], sorted(names_e - names_r)[:3]
        return (f"expected {len(expected)} parameters, received {len(received)}"
                + (f"; unexpected {extra}" if extra else "") + (f"; missing {missing}" if missing else ""))
    for e, r in zip(expected, received):
        if e != r:
            return f"expected {e.describe()}, received {r.describe()}"
    return None  # pragma: no cover - lists differ, so some pair differs


def assign_shards(specs: Sequence[ParamSpec], num_ps: int) -> list[list[int]]:
    """Return, for each ps task, the indices (into ``specs``, ascending) of the parameters it holds.

    Greedy: largest parameter first, each to the least-loaded ps task (by bytes; ties to the lower index).
    """
    if num_ps < 1:
        raise InvalidArgumentError(f"num_ps must be >= 1. Received: {num_ps}.")
    load = [0] * num_ps
    shards: list[list[int]] = [[] for _ in range(num_ps)]
    for i in sorted(range(len(specs)), key=lambda i: (-specs[i].nbytes, i)):
        target = min(range(num_ps), key=lambda p: (load[p], p))
        shards[target].append(i)
        load[target] += specs[i].nbytes
    return [sorted(s) for s in shards]


class FlatLayout:
    """Byte offsets of a shard's parameters inside one flat ``uint8`` buffer (grouped by dtype, aligned)."""

    def __init__(self, specs: Sequence[ParamSpec]):
        self.specs = list(specs)
        self.offsets: list[int] = [0] * len(self.specs)
        #: ``(dtype, start_byte, end_byte)`` of each dtype's contiguous region.
        self.regions: list[tuple[torch.dtype, int, int]] = []
        cursor = 0
        for dtype_name in dict.fromkeys(s.dtype for s in self.specs):
            start = cursor
            for i, s in enumerate(self.specs):
                if s.dtype == dtype_name:
                    self.offsets[i] = cursor
                    cursor += -(-s.nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
            self.regions.append((_dtype(dtype_name), start, cursor))
        self.nbytes = cursor

    def new_buffer(self) -> torch.Tensor:
        """Return a zeroed buffer of this layout (padding stays zero, so whole regions can be summed)."""
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Return one typed, shaped view of ``buffer`` per parameter (no copy)."""
        if buffer.numel() != self.nbytes:
            raise InvalidArgumentError(f"buffer has {buffer.numel()} bytes, the layout needs {self.nbytes}.")
        return [buffer[o:o + s.nbytes].view(_dtype(s.dtype)).view(s.shape) for o, s in zip(self.offsets, self.specs)]

    def segments(self, min_bytes: int) -> list[tuple[int, int, int | None]]:
        """Return ``(start, end, i)`` byte ranges covering the buffer: parameter ``i``'s own bytes when it has at
        least ``min_bytes``, else ``i=None`` for a stretch of small parameters and padding.

        A push sends a large gradient straight from ``p.grad`` as its own piece; both sides cut the same pieces.
        """
        out: list[tuple[int, int, int | None]] = []
        cursor = 0
        for i in sorted(range(len(self.specs)), key=lambda i: self.offsets[i]):
            nbytes = self.specs[i].nbytes
            if nbytes < min_bytes:
                continue
            if self.offsets[i] > cursor:
                out.append((cursor, self.offsets[i], None))
            out.append((self.offsets[i], self.offsets[i] + nbytes, i))
            cursor = self.offsets[i] + nbytes
        if cursor < self.nbytes:
            out.append((cursor, self.nbytes, None))
        return out

    def region_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Return one 1-D typed view per dtype region of ``buffer`` (for whole-shard arithmetic)."""
        return [buffer[a:b].view(dtype) for dtype, a, b in self.regions if b > a]
