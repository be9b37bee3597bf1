"""How a DiLoCo worker's parameter change travels: float32 as it is, or bf16 / int8 with error feedback.

The worker keeps what rounding took away (the residual) and adds it to its next change, so no part of a
change is lost, only delayed (as in 1-bit SGD and DiLoCo's quantised variants). int8 values carry one float32
scale per tensor (``max |x| / 127``). A compressed change rides in the message's JSON part as typed tensors
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
WIRE_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
_INT8_MAX = 127.0


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
            if self.compression == "int8":
                scale = float(x.abs().max()) / _INT8_MAX if x.numel() else 0.0
                scale = scale if scale > 0 else 1.0
                q = torch.round(x / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
                sent = q.float() * scale
                scales.append(scale)
            else:
                q = x.to(WIRE_DTYPES[self.compression])
                sent = q.float()
            self._residual[i] = x - sent
            values.append(q)
        packed: dict[str, Any] = {"codec": self.compression, "values": values}
        if self.compression == "int8":
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
    if codec == "int8" and (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32
                            or scales.numel() != len(present)):
        raise refuse("int8 values need one float32 scale per tensor")
    for view in views:
        view.zero_()
    for k, (i, value) in enumerate(zip(present, values)):
        view = views[i]
        if not isinstance(value, torch.Tensor) or value.dtype != WIRE_DTYPES[codec] or value.numel() != view.numel():
            raise refuse(f"parameter {i} needs {view.numel()} {codec} values")
        decoded = value.float() * float(scales[k]) if isinstance(scales, torch.Tensor) and codec == "int8" else value
        view.copy_(decoded.reshape(view.shape))
    return flat
