"""How a DiLoCo worker's parameter change travels: float32 as it is, or bf16 / int8 / int4 with error feedback.

The worker keeps what rounding took away (the residual) and adds it to its next change, so no part of a
change is lost, only delayed (as in 1-bit SGD and DiLoCo's quantised variants). int8 and int4 values carry
one float32 scale per tensor (``max |x| / 127``, ``max |x| / 7``); int4 packs two values per byte (``q + 8``
in each nibble, the low one first). A compressed change rides in the message's JSON part as typed tensors
(``wire.py``: dtype and shape named, never unpickled); the ps task checks every count, shape and dtype before
it turns them back into the shard's float values.
"""

from __future__ import annotations

from typing import Any

import torch

from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.sharding import FlatLayout
from towers.strategies.parameter_server.transport import Status

__all__ = ["DeltaEncoder", "unpack_delta", "WIRE_DTYPES"]

#: The dtype each compression puts on the wire. A float32 change travels packed only when it is part of a shard
#: (a fragment); a whole shard's goes as the push's flat buffer.
WIRE_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
#: The largest magnitude of each integer code (a symmetric range: 0 stays exact).
_LEVELS = {"int8": 127.0, "int4": 7.0}


def _wire_numel(codec: str, numel: int) -> int:
    """Values on the wire for a tensor of ``numel`` values: int4 packs two per byte."""
    return (numel + 1) // 2 if codec == "int4" else numel


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 codes in [-7, 7] two per byte (an odd count is padded with a zero)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
    return u[0::2] | (u[1::2] << 4)


def _unnibble(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The int4 codes ``_nibbles`` packed, as float32."""
    low, high = (packed & 15).to(torch.int16) - 8, (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel].float()


class DeltaEncoder:
    """A worker's compression of its parameter changes, with one residual per parameter (error feedback)."""

    def __init__(self, compression: str):
        self.compression = compression
        self._residual: dict[int, torch.Tensor] = {}

    def pack(self, deltas: list[tuple[int, torch.Tensor]]) -> dict[str, Any]:
        """Return the ``packed`` meta for ``deltas`` (``(parameter index, change)`` in shard order), keeping residuals."""
        values, scales = [], []
        for i, delta in deltas:
            x = delta.detach().float().reshape(-1)
            if self.compression == "float32":  # nothing rounded away: no residual
                values.append(x)
                continue
            if i in self._residual:
                x = x + self._residual[i]
            if self.compression in _LEVELS:
                levels = _LEVELS[self.compression]
                scale = float(x.abs().max()) / levels if x.numel() else 0.0
                scale = scale if scale > 0 else 1.0
                codes = torch.round(x / scale).clamp_(-levels, levels)
                sent = codes * scale
                q = codes.to(torch.int8) if self.compression == "int8" else _nibbles(codes)
                scales.append(scale)
            else:
                q = x.to(WIRE_DTYPES[self.compression])
                sent = q.float()
            self._residual[i] = x - sent
            values.append(q)
        packed: dict[str, Any] = {"codec": self.compression, "values": values}
        if self.compression in _LEVELS:
            packed["scales"] = torch.tensor(scales, dtype=torch.float32)
        return packed

    def reset(self) -> None:
        """Forget the residuals (a checkpoint load set new parameters)."""
        self._residual.clear()


def unpack_delta(packed: Any, layout: FlatLayout, mask: list[bool] | None, out: torch.Tensor | None,
                 ps_index: int) -> torch.Tensor:
    """Return the shard's flat buffer (``out`` when given) holding the changes ``packed`` carries; zeros elsewhere.

    Raises:
        RequestError: (bad input) the packed changes do not match the shard: codec, count, size or dtype.
    """
    def refuse(why: str) -> RequestError:
        return RequestError(f"ps task {ps_index}: a compressed DiLoCo push does not match the shard: {why}. Every "
                            "process of the job must run the same towers version.", Status.BAD_INPUT)

    if not isinstance(packed, dict) or packed.get("codec") not in WIRE_DTYPES or not isinstance(packed.get("values"), list):
        raise refuse(f"expected a codec of {tuple(WIRE_DTYPES)} and a list of values, got {type(packed).__name__}")
    codec, values = packed["codec"], packed["values"]
    flat = out if out is not None and out.numel() == layout.nbytes else layout.new_buffer()
    views = layout.views(flat)
    present = [i for i in range(len(views)) if mask is None or mask[i]]
    if len(values) != len(present):
        raise refuse(f"{len(values)} tensor(s) for {len(present)} parameter(s)")
    scales = packed.get("scales")
    if codec in _LEVELS and (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32
                             or scales.numel() != len(present)):
        raise refuse(f"{codec} values need one float32 scale per tensor")
    for view in views:
        view.zero_()
    for k, (i, value) in enumerate(zip(present, values)):
        view = views[i]
        wire = _wire_numel(codec, view.numel())
        if not isinstance(value, torch.Tensor) or value.dtype != WIRE_DTYPES[codec] or value.numel() != wire:
            raise refuse(f"parameter {i} needs {wire} {WIRE_DTYPES[codec]} values ({codec})")
        decoded = value
        if isinstance(scales, torch.Tensor) and codec in _LEVELS:
            codes = _unnibble(value.reshape(-1), view.numel()) if codec == "int4" else value.float()
            decoded = codes * float(scales[k])
        view.copy_(decoded.reshape(view.shape))
    return flat
