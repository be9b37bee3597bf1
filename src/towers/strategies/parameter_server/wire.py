"""What may cross a parameter-server link: JSON values and tensors, nothing that can run code.

A message's ``meta`` part is a tree of ``None``, ``bool``, ``int``, ``float``, ``str``, lists,
tuples, dicts and dense tensors. ``encode`` turns it into one JSON document (read back with
``json.loads`` only) plus one byte blob holding every tensor's raw bytes, in order; the JSON
names each tensor's dtype (from a fixed list) and shape, so the receiver checks sizes before it
builds a tensor. Nothing is ever unpickled: a peer that sends anything else gets a
``ProtocolError``, which the ps reports and answers by dropping that link.

JSON markers (every other dict has plain string keys that do not start with ``$``)::

    {"$t": i}                 the i-th tensor of the blob
    {"$tuple": [...]}         a tuple
    {"$dict": [[k, v], ...]}  a dict whose keys are not all plain strings (e.g. optimizer state indices)
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from towers.errors import InvalidTypeError, TowersError

__all__ = ["ProtocolError", "encode", "decode", "DTYPES", "MAX_JSON_BYTES"]

#: Tensor dtypes a link carries, by the name used in the JSON header.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
#: The largest JSON part a receiver accepts (a header from a confused or hostile peer cannot make it allocate more).
MAX_JSON_BYTES = 64 * 1024 * 1024
_MAX_DEPTH = 64


class ProtocolError(TowersError, ValueError):
    """A peer sent bytes that are not a message of this protocol (never executed, never unpickled)."""


def encode(value: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Return ``(json_bytes, tensors)`` for ``value``: the tensors' raw bytes travel after the JSON, in order.

    Raises:
        TypeError: ``value`` holds something other than JSON values, tuples and dense tensors.
    """
    tensors: list[torch.Tensor] = []
    specs: list[list[Any]] = []

    def walk(v: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise InvalidTypeError(f"the value nests deeper than {_MAX_DEPTH} levels.")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.dtype not in _NAMES:
                raise InvalidTypeError(f"a tensor of layout {v.layout} and dtype {v.dtype} cannot travel; dense tensors of "
                                       f"dtype {', '.join(DTYPES)} can.")
            t = v.detach().to("cpu").contiguous()
            specs.append([_NAMES[t.dtype], list(t.shape)])
            tensors.append(t)
            return {"$t": len(tensors) - 1}
        if isinstance(v, tuple):
            return {"$tuple": [walk(x, depth + 1) for x in v]}
        if isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: walk(x, depth + 1) for k, x in v.items()}
            return {"$dict": [[walk(k, depth + 1), walk(x, depth + 1)] for k, x in v.items()]}
        raise InvalidTypeError(f"a {type(v).__module__}.{type(v).__qualname__} cannot travel to or from a parameter server: "
                               "its links carry None, bool, int, float, str, lists, tuples, dicts and dense tensors only "
                               "(no pickled objects). Convert the value to those types first.")

    tree = walk(value, 0)
    blob = json.dumps({"v": tree, "t": specs}, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return blob, tensors


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Return the total size of ``tensors`` in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)


def decode(raw: bytes, blob: torch.Tensor | None) -> Any:
    """Return the value ``encode`` wrote: ``raw`` is the JSON part, ``blob`` the tensors' bytes (uint8).

    Raises:
        ProtocolError: the JSON is malformed, names an unknown dtype or marker, or the sizes do not add up.
    """
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"the message header is not JSON ({type(exc).__name__}: {exc}; first bytes "
                            f"{raw[:16]!r})") from None
    if not isinstance(doc, dict) or set(doc) != {"v", "t"} or not isinstance(doc["t"], list):
        raise ProtocolError(f"the message header must be a JSON object with keys 'v' and 't'. Received keys: "
                            f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    tensors, offset = [], 0
    data = blob if blob is not None else torch.empty(0, dtype=torch.uint8)
    for spec in doc["t"]:
        if (not isinstance(spec, list) or len(spec) != 2 or spec[0] not in DTYPES or not isinstance(spec[1], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec[1])):
            raise ProtocolError(f"bad tensor description {spec!r}: expected [dtype, shape] with dtype one of "
                                f"{', '.join(DTYPES)} and a list of sizes >= 0")
        dtype, shape = DTYPES[spec[0]], spec[1]
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > data.numel():
            raise ProtocolError(f"the header describes more tensor bytes than the message carries "
                                f"({offset + nbytes} > {data.numel()})")
        # A copy per tensor: each owns its memory (torch.save refuses views of one buffer as several dtypes), copied
        # before it is viewed as its dtype: after a tensor of an odd byte count the offset fits no wider dtype.
        tensors.append(data[offset:offset + nbytes].clone().view(dtype).view(shape) if nbytes
                       else torch.empty(shape, dtype=dtype))
        offset += nbytes
    if offset != data.numel():
        raise ProtocolError(f"the message carries {data.numel()} tensor bytes, its header describes {offset}")

    def walk(v: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ProtocolError(f"the message nests deeper than {_MAX_DEPTH} levels")
        if isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1:
            (key, x), = v.items()
            if key == "$t":
                if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < len(tensors):
                    raise ProtocolError(f"tensor reference {x!r} is out of range (the message has {len(tensors)})")
                return tensors[x]
            if key == "$tuple" and isinstance(x, list):
                return tuple(walk(y, depth + 1) for y in x)
            if key == "$dict" and isinstance(x, list):
                if not all(isinstance(p, list) and len(p) == 2 for p in x):
                    raise ProtocolError("a '$dict' entry must be a list of [key, value] pairs")
                out = {}
                for k, y in x:
                    k = walk(k, depth + 1)
                    if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                        raise ProtocolError(f"a dict key must be a str, number, bool, None or tuple, not {type(k).__name__}")
                    out[k] = walk(y, depth + 1)
                return out
            if key == "$float" and x in ("nan", "inf", "-inf"):
                return float(x)
        if any(isinstance(k, str) and k.startswith("$") for k in v):
            raise ProtocolError(f"unknown marker in {sorted(v)[:3]}")
        return {k: walk(x, depth + 1) for k, x in v.items()}

    return walk(doc["v"], 0)
