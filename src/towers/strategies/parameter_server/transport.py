"""The only module that talks to the wire: Gloo point-to-point messages between a worker and a ps task.

Each (worker, ps task) pair gets its own two-rank Gloo group, built over the job's rendezvous
store. A dead worker therefore breaks only its own pairs; a Gloo timeout (which leaves a group
unusable) likewise stays inside one pair. The pairs bind where the job's process group binds:
they share its Gloo device, so the interface chosen for the job (``towers launch --interface``,
``GLOO_SOCKET_IFNAME``, or the one ``towers.network`` detects across hosts) carries them too, and
a host name that resolves to loopback on its own host cannot send a peer to 127.0.1.1.

A message is a fixed header, then an optional pickled ``meta`` object, then an optional flat
byte buffer (a whole shard: one send per shard)::

    header  int64[8] = [op, status, meta_nbytes, flat_nbytes, a, b, c, d]
    meta    uint8[meta_nbytes]   pickle of a small Python object (specs, masks, state dicts)
    flat    uint8[flat_nbytes]   gradients or parameters of one shard, received in place

Gloo point-to-point cannot be polled (``is_completed`` stays false until ``wait``), so each ps
link is served by a thread blocked in ``recv``; every wait carries an explicit timeout.
"""

from __future__ import annotations

import datetime
import itertools
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from towers.process_group import first_line

__all__ = ["Op", "Status", "Message", "LinkError", "Link", "open_link", "next_generation", "rendezvous_store",
           "LISTEN_TIMEOUT_S"]

#: How long a ps thread waits for a worker's next request: workers may compute (or evaluate) for
#: long stretches without talking to the ps; a crashed worker is still seen at once (TCP reset).
LISTEN_TIMEOUT_S = 7 * 24 * 3600.0

_HEADER_LEN = 8
_TAG = 0
_generation = itertools.count()


class Op:
    """Request kinds (worker -> ps) and the reply kind (ps -> worker)."""

    REGISTER, PUSH, PULL, SET_PARAMS, GET_STATE, SET_STATE, STATS, GATHER, BYE, REPLY = range(1, 11)
    NAMES = {1: "register", 2: "push", 3: "pull", 4: "set_params", 5: "get_state", 6: "set_state",
             7: "stats", 8: "gather", 9: "bye", 10: "reply"}


class Status:
    """Reply status: ``OK``; ``BAD_INPUT`` (raise ValueError on the worker); ``FAILED`` (DistributedError)."""

    OK, BAD_INPUT, FAILED = 0, 1, 2


@dataclass
class Message:
    """One received message: ``op``, ``status``, four small ints, the unpickled ``meta`` and the ``flat`` buffer."""

    op: int
    status: int
    ints: tuple[int, int, int, int]
    meta: Any = None
    flat: torch.Tensor | None = None


class LinkError(RuntimeError):
    """The peer of a link is gone (``kind="gone"``) or did not answer in time (``kind="timeout"``)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def next_generation() -> int:
    """Return a fresh number for this process's next set of links (every process opens them in the same order)."""
    return next(_generation)


def rendezvous_store() -> dist.Store:
    """Return the store of the job's default process group (which must exist)."""
    return dist.distributed_c10d._get_default_store()


def open_link(store: dist.Store, *, worker: int, ps: int, is_ps: bool, bind_host: str, timeout_s: float,
              generation: int = 0, name: str = "") -> "Link":
    """Open the two-rank Gloo group of (worker, ps task) and return this side's ``Link``.

    The group binds the default process group's interface; ``bind_host`` only matters without one.

    Blocks until the peer opens its side too (at most ``timeout_s``). Raises ``LinkError`` on failure.
    """
    options = dist.ProcessGroupGloo._Options()
    options._devices = _devices(bind_host)
    options._timeout = datetime.timedelta(seconds=timeout_s)
    prefix = dist.PrefixStore(f"towers/ps/{generation}/w{worker}-p{ps}", store)
    try:
        group = dist.ProcessGroupGloo(prefix, 1 if is_ps else 0, 2, options)
    except RuntimeError as exc:
        raise LinkError(f"could not connect {name or 'the link'} within {timeout_s:g} s: {first_line(exc)}",
                        "timeout" if "timeout" in str(exc).lower() else "gone") from exc
    return Link(group, peer=0 if is_ps else 1, name=name)


def _devices(bind_host: str) -> list[Any]:
    """The Gloo devices of the job's default group (bound to the job's interface), else one for ``bind_host``."""
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

    def send(self, op: int, *, timeout_s: float, status: int = Status.OK, ints: tuple[int, ...] = (),
             meta: Any = None, flat: torch.Tensor | None = None) -> None:
        """Send one message and wait until it is handed over. Raises ``LinkError``."""
        payload = None if meta is None else pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        padded = (tuple(ints) + (0, 0, 0, 0))[:4]
        header = torch.tensor([op, status, len(payload) if payload is not None else 0,
                               flat.numel() * flat.element_size() if flat is not None else 0, *padded],
                              dtype=torch.int64)
        tensors = [header]
        if payload is not None:
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if flat is not None and flat.numel():
            tensors.append(flat if flat.dtype == torch.uint8 else flat.view(torch.uint8))
        self._run("send", lambda: [self._group.send([t], self._peer, _TAG) for t in tensors], timeout_s)

    def recv(self, *, timeout_s: float, first_timeout_s: float | None = None,
             flat_out: Callable[[Message], torch.Tensor | None] | None = None) -> Message:
        """Receive one message; ``flat_out(message)`` may return the buffer its flat part lands in (else a new one).

        ``first_timeout_s`` bounds the wait for the message to start (default ``timeout_s``).
        Raises ``LinkError``.
        """
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        wait_first = timeout_s if first_timeout_s is None else first_timeout_s
        self._run("recv", lambda: [self._group.recv([header], self._peer, _TAG)], wait_first)
        op, status, meta_nbytes, flat_nbytes, *ints = (int(v) for v in header.tolist())
        message = Message(op, status, (ints[0], ints[1], ints[2], ints[3]))
        if meta_nbytes:
            raw = torch.empty(meta_nbytes, dtype=torch.uint8)
            self._run("recv", lambda: [self._group.recv([raw], self._peer, _TAG)], timeout_s)
            message.meta = pickle.loads(raw.numpy().tobytes())
        if flat_nbytes:
            out = flat_out(message) if flat_out is not None else None
            if out is None or out.numel() * out.element_size() != flat_nbytes:
                out = torch.empty(flat_nbytes, dtype=torch.uint8)
            target = out if out.dtype == torch.uint8 else out.view(torch.uint8)
            self._run("recv", lambda: [self._group.recv([target], self._peer, _TAG)], timeout_s)
            message.flat = out
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
