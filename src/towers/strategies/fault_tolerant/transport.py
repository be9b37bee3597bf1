"""How a healing replica group receives the live state: towers' wire format over the quorum's process group.

torchft's own ``PGTransport`` sends the state's structure as a pickle, which the receiver
unpickles; towers never unpickles what it reads from the network. ``WireTransport`` sends the
same state (model, optimizer and torchft's step counters) as the parameter servers' messages are
sent: one JSON document (read with ``json.loads``) and one blob of tensor bytes whose dtypes and
shapes the JSON names (``towers.strategies.parameter_server.wire``), in three point-to-point
messages: a header of two lengths, the JSON, the blob.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from towers.strategies.parameter_server.wire import MAX_JSON_BYTES, ProtocolError, decode, encode

__all__ = ["WireTransport"]

_HEADER, _JSON, _BLOB = 1, 2, 3  # message tags


def _transport_base() -> type:
    from torchft.checkpointing.transport import CheckpointTransport

    return CheckpointTransport


def WireTransport(pg: Any, timeout: timedelta) -> Any:  # noqa: N802 - a class made on first use (torchft is optional)
    """Return a torchft checkpoint transport that sends a state as JSON and tensor bytes over ``pg`` (no pickle)."""
    return _wire_transport_class()(pg, timeout)


_CLASS: list[type] = []


def _wire_transport_class() -> type:
    if _CLASS:
        return _CLASS[0]

    class _WireTransport(_transport_base()):  # type: ignore[misc]
        def __init__(self, pg: Any, timeout: timedelta) -> None:
            self._pg = pg
            self._timeout = timeout

        def metadata(self) -> str:
            return "towers-wire"

        def disallow_checkpoint(self) -> None:
            pass  # send_checkpoint returns once every message is sent

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            raw, tensors = encode({"step": int(step), "state": state_dict})
            blob = (torch.cat([t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors])
                    if tensors else torch.empty(0, dtype=torch.uint8))
            header = torch.tensor([len(raw), blob.numel()], dtype=torch.int64)
            text = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            works = []
            for dst in dst_ranks:
                works.append(self._pg.send([header], dst, tag=_HEADER))
                works.append(self._pg.send([text], dst, tag=_JSON))
                if blob.numel():
                    works.append(self._pg.send([blob], dst, tag=_BLOB))
            for work in works:
                work.wait(timeout)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            if metadata != "towers-wire":
                raise ProtocolError(f"the live replica group sends its state as {metadata!r}, not towers' wire format: "
                                    "every group of the job must run FaultTolerantStrategy of the same towers.")
            header = torch.zeros(2, dtype=torch.int64)
            self._pg.recv([header], src_rank, tag=_HEADER).wait(timeout)
            json_bytes, blob_bytes = (int(v) for v in header.tolist())
            if not 0 < json_bytes <= MAX_JSON_BYTES or blob_bytes < 0:
                raise ProtocolError(f"a state header with {json_bytes} JSON and {blob_bytes} tensor bytes")
            text = torch.empty(json_bytes, dtype=torch.uint8)
            self._pg.recv([text], src_rank, tag=_JSON).wait(timeout)
            blob = torch.empty(blob_bytes, dtype=torch.uint8)
            if blob_bytes:
                self._pg.recv([blob], src_rank, tag=_BLOB).wait(timeout)
            value = decode(text.numpy().tobytes(), blob)
            if not isinstance(value, dict) or value.get("step") != step:
                raise ProtocolError(f"a state for step {value.get('step') if isinstance(value, dict) else '?'} when step "
                                    f"{step} was asked for")
            return value["state"]

    _CLASS.append(_WireTransport)
    return _WireTransport
