"""The only module that talks to the wire: Gloo point-to-point messages between a worker and a ps task.

Each (worker, ps task) pair gets its own two-rank Gloo group, built over the job's rendezvous
store. A dead worker therefore breaks only its own pairs; a Gloo timeout (which leaves a group
unusable) likewise stays inside one pair. The pairs bind where the job's process group binds:
they share its Gloo device, so the interface chosen for the job (``towers launch --interface``,
``GLOO_SOCKET_IFNAME``, or the one ``towers.network`` detects across hosts) carries them too, and
a host name that resolves to loopback on its own host cannot send a peer to 127.0.1.1.

A message is a fixed header, then an optional ``meta`` value as JSON plus the raw bytes of the
tensors it holds (``wire.py``: dtype and shape in the JSON, never a pickle), then an optional
flat byte buffer (a whole shard), sent in one piece or in ``segments`` pieces whose sizes both
sides derive from the shard's layout (a large gradient goes out straight from ``p.grad``, with
no copy into the flat buffer)::

    header  int64[11] = [MAGIC, op, status, json_nbytes, blob_nbytes, flat_nbytes, segments, a, b, c, d]
    json    uint8[json_nbytes]   UTF-8 JSON (read with json.loads only): small values, tensor specs
    blob    uint8[blob_nbytes]   the raw bytes of the tensors the JSON names, in order
    flat    uint8[flat_nbytes]   gradients or parameters of one shard, received in place

Every part is received before the JSON is decoded, so a message that breaks the protocol leaves
the link aligned; the receiver raises ``ProtocolError`` (the ps answers with the error and drops
the link). A header with the wrong magic or impossible sizes is refused before anything is read.

Gloo point-to-point cannot be polled (``is_completed`` stays false until ``wait``), so each ps
link is served by a thread blocked in ``recv``; every wait carries an explicit timeout.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from towers.errors import TowersError
from towers.process_group import first_line
from towers.strategies.parameter_server.wire import MAX_JSON_BYTES, ProtocolError, decode, encode, tensor_bytes

__all__ = ["Op", "Status", "Message", "LinkError", "ProtocolError", "Link", "open_link", "next_generation",
           "rendezvous_store", "LISTEN_TIMEOUT_S", "MAGIC"]

#: How long a ps thread waits for a worker's next request: workers may compute (or evaluate) for
#: long stretches without talking to the ps; a crashed worker is still seen at once (TCP reset).
LISTEN_TIMEOUT_S = 7 * 24 * 3600.0

_HEADER_LEN = 11
#: First word of every header: "towersP2" (wire format 2: JSON + tensors; format 1 pickled its meta).
MAGIC = int.from_bytes(b"towersP2", "little")
#: The largest flat or tensor part a receiver accepts from a header (a confused peer cannot make it allocate more).
_MAX_PART_BYTES = 1 << 40
_TAG = 0
_generation = itertools.count()


class Op:
    """Request kinds (worker -> ps) and the reply kind (ps -> worker)."""

    REGISTER, PUSH, PULL, SET_PARAMS, GET_STATE, SET_STATE, STATS, GATHER, BYE, REPLY = range(1, 11)
    EMB_REGISTER, EMB_PULL, EMB_PUSH, EMB_GET, EMB_SET, DISPATCH = range(11, 17)
    NAMES = {1: "register", 2: "push", 3: "pull", 4: "set_params", 5: "get_state", 6: "set_state",
             7: "stats", 8: "gather", 9: "bye", 10: "reply", 11: "embedding_register", 12: "embedding_pull",
             13: "embedding_push", 14: "embedding_get", 15: "embedding_set", 16: "dispatch"}


class Status:
    """Reply status: ``OK``; ``BAD_INPUT`` (raise ValueError on the worker); ``FAILED`` (DistributedError)."""

    OK, BAD_INPUT, FAILED = 0, 1, 2


@dataclass
class Message:
    """One received message: ``op``, ``status``, four small ints, the decoded ``meta`` and the ``flat`` buffer."""

    op: int
    status: int
    ints: tuple[int, int, int, int]
    meta: Any = None
    flat: torch.Tensor | None = None


class LinkError(TowersError, RuntimeError):
    """The peer of a link is gone (``kind="gone"``) or did not answer in time (``kind="timeout"``)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def next_generation() -> int:
    """Return a fresh number for this process's next set of links (every process opens them in the same order)."""
    return next(_generation)


def rendezvous_store() -> dist.Store:
    """Return the store of the job's default process group (which must exist)."""
    # torch offers the default group's store only through this private function.
    return dist.distributed_c10d._get_default_store()


def open_link(store: dist.Store, *, worker: int, ps: int, is_ps: bool, bind_host: str, timeout_s: float,
              generation: int = 0, name: str = "") -> "Link":
    """Open the two-rank Gloo group of (worker, ps task) and return this side's ``Link``.

    The group binds the default process group's interface; ``bind_host`` only matters without one.

    Blocks until the peer opens its side too (at most ``timeout_s``). Raises ``LinkError`` on failure.
    """
    options = _gloo_options(_devices(bind_host), timeout_s)
    prefix = dist.PrefixStore(f"towers/ps/{generation}/w{worker}-p{ps}", store)
    try:
        group = dist.ProcessGroupGloo(prefix, 1 if is_ps else 0, 2, options)
    except RuntimeError as exc:
        raise LinkError(f"could not connect {name or 'the link'} within {timeout_s:g} s: {first_line(exc)}",
                        "timeout" if "timeout" in str(exc).lower() else "gone") from exc
    return Link(group, peer=0 if is_ps else 1, name=name)


def _gloo_options(devices: list[Any], timeout_s: float) -> Any:
    """Options of a Gloo group on ``devices`` whose operations wait at most ``timeout_s``."""
    # torch builds a Gloo group on chosen devices only from its private options class (what init_process_group
    # does inside); the public constructors take no device.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = devices
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return options


def _devices(bind_host: str) -> list[Any]:
    """The Gloo devices of the job's default group (bound to the job's interface), else one for ``bind_host``."""
    # torch exposes neither the default group nor its Gloo devices publicly: read through its privates, and fall
    # back to a device of our own when they moved.
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        devices = list(backend.options._devices)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError, ValueError):  # no default group, not Gloo, or an older torch
        devices = []
    if devices:
        return devices
    if bind_host:
        return [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return [dist.ProcessGroupGloo.create_default_device()]


class Link:
    """One side of a (worker, ps task) pair: send and receive messages, every wait bounded."""

    def __init__(self, group: Any, *, peer: int, name: str):
        self._group = group
        self._peer = peer
        self.name = name
        self.broken: str | None = None
        #: bytes this side handed to and received from the wire (headers included): what a step costs
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, op: int, *, timeout_s: float, status: int = Status.OK, ints: tuple[int, ...] = (),
             meta: Any = None, flat: torch.Tensor | None = None,
             flat_parts: list[torch.Tensor] | None = None) -> None:
        """Send one message and wait until it is handed over.

        ``flat_parts``: the flat part as several contiguous pieces (sent one after the other, in place
        of ``flat``); the receiver must split it the same way (``recv(flat_split=...)``).

        Raises:
            LinkError: the peer is gone or silent.
            TypeError: ``meta`` holds a value the wire does not carry (see ``wire.encode``).
        """
        raw, tensors = (b"", []) if meta is None else encode(meta)
        padded = (tuple(ints) + (0, 0, 0, 0))[:4]
        pieces = [f if f.dtype == torch.uint8 else f.view(torch.uint8) for f in flat_parts] if flat_parts else \
            ([flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)] if flat is not None and flat.numel() else [])
        pieces = [f for f in pieces if f.numel()]
        header = torch.tensor([MAGIC, op, status, len(raw), tensor_bytes(tensors), sum(f.numel() for f in pieces),
                               len(pieces), *padded], dtype=torch.int64)
        parts = [header]
        if raw:
            parts.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        if tensors:
            # One send for all of them: a message's tensors are small next to a shard (ids, rows, state).
            blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if len(tensors) > 1 \
                else tensors[0].reshape(-1).view(torch.uint8)
            if blob.numel():
                parts.append(blob)
        parts.extend(pieces)
        self._run("send", lambda: [self._group.send([t], self._peer, _TAG) for t in parts], timeout_s)
        self.bytes_sent += sum(t.numel() * t.element_size() for t in parts)

    def recv(self, *, timeout_s: float, first_timeout_s: float | None = None,
             flat_out: Callable[[Message], torch.Tensor | None] | None = None,
             flat_split: Callable[[Message], list[int]] | None = None) -> Message:
        """Receive one message; ``flat_out(message)`` may return the buffer its flat part lands in (else a new one).

        ``first_timeout_s`` bounds the wait for the message to start (default ``timeout_s``).
        ``flat_split(message)``: the byte sizes of the pieces a flat part sent in pieces arrives in.

        Raises:
            LinkError: the peer is gone or silent.
            ProtocolError: the peer sent something that is not a message of this protocol (nothing of it is
                executed). After a bad header the link is unusable (``broken``).
        """
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        wait_first = timeout_s if first_timeout_s is None else first_timeout_s
        self._run("recv", lambda: [self._group.recv([header], self._peer, _TAG)], wait_first)
        magic, op, status, json_nbytes, blob_nbytes, flat_nbytes, segments, *ints = (int(v) for v in header.tolist())
        if magic != MAGIC or not 0 <= json_nbytes <= MAX_JSON_BYTES or not 0 <= blob_nbytes <= _MAX_PART_BYTES \
                or not 0 <= flat_nbytes <= _MAX_PART_BYTES or not 0 <= segments <= 1 << 20:
            self.broken = "protocol error: bad header"
            raise ProtocolError(
                f"{self.name or 'the peer'} sent a header that is not towers' parameter-server wire format 2 "
                f"(magic {magic:#x}, expected {MAGIC:#x}; json {json_nbytes} B, tensors {blob_nbytes} B, flat "
                f"{flat_nbytes} B). Every process of the job must run the same towers version.")
        message = Message(op, status, (ints[0], ints[1], ints[2], ints[3]))
        self.bytes_received += header.numel() * 8 + json_nbytes + blob_nbytes + flat_nbytes
        try:
            raw = torch.empty(json_nbytes, dtype=torch.uint8)
            blob = torch.empty(blob_nbytes, dtype=torch.uint8)
        except RuntimeError as exc:  # a header asking for more memory than this host has
            self.broken = "protocol error: message too large"
            raise ProtocolError(f"{self.name or 'the peer'} announced a message of {json_nbytes + blob_nbytes} B "
                                f"that cannot be allocated here ({first_line(exc)}).") from None
        if json_nbytes:
            self._run("recv", lambda: [self._group.recv([raw], self._peer, _TAG)], timeout_s)
        if blob_nbytes:
            self._run("recv", lambda: [self._group.recv([blob], self._peer, _TAG)], timeout_s)
        if flat_nbytes:
            out = flat_out(message) if flat_out is not None else None
            if out is None or out.numel() * out.element_size() != flat_nbytes:
                try:
                    out = torch.empty(flat_nbytes, dtype=torch.uint8)
                except RuntimeError as exc:
                    self.broken = "protocol error: message too large"
                    raise ProtocolError(f"{self.name or 'the peer'} announced {flat_nbytes} B of parameters that "
                                        f"cannot be allocated here ({first_line(exc)}).") from None
            target = out if out.dtype == torch.uint8 else out.view(torch.uint8)
            sizes = [flat_nbytes]
            if segments > 1:
                sizes = [n for n in (flat_split(message) if flat_split is not None else []) if n]
                rows = flat_nbytes // sum(sizes) if sizes and flat_nbytes % sum(sizes) == 0 else 1
                sizes = sizes * rows if segments == len(sizes) * rows else sizes  # rows cut alike (bitwise pushes)
                if len(sizes) != segments or sum(sizes) != flat_nbytes:
                    self.broken = "protocol error: flat pieces"
                    raise ProtocolError(f"{self.name or 'the peer'} sent {flat_nbytes} B in {segments} pieces; this "
                                        f"side expected pieces of {sizes} B. Every process must build the same model.")
            starts = [sum(sizes[:k]) for k in range(len(sizes))]
            self._run("recv", lambda: [self._group.recv([target[a:a + n]], self._peer, _TAG)
                                       for a, n in zip(starts, sizes)], timeout_s)
            message.flat = out
        if json_nbytes:  # decoded only once the whole message is in: the link stays aligned on a bad one
            message.meta = decode(raw.numpy().tobytes(), blob)
        elif blob_nbytes:
            raise ProtocolError(f"{self.name or 'the peer'} sent {blob_nbytes} tensor bytes without a header "
                                "describing them.")
        return message

    def _run(self, what: str, start: Callable[[], list[Any]], timeout_s: float) -> None:
        if self.broken is not None:
            raise LinkError(self.broken, "gone")
        try:
            works = start()
            for work in works:
                work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            text = str(exc)
            kind = "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "gone"
            reason = (f"no {what} completed within {timeout_s:g} s" if kind == "timeout"
                      else f"connection lost ({first_line(exc)})")
            # A Gloo timeout or I/O error leaves the pair unusable: fail fast from now on.
            self.broken = reason
            raise LinkError(reason, kind) from exc

    def close(self) -> None:
        """Drop the group (idempotent); later sends and receives raise ``LinkError``."""
        if self.broken is None:
            self.broken = "link closed"
        self._group = None
