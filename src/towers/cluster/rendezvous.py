"""Waiting for the other processes (or nodes) of a job: visible, bounded, and fast to fail on a bad address.

Torch-free: ``join`` works on any key-value store with ``set``, ``check`` and ``get`` (a
``torch.distributed.TCPStore`` in practice, a dict-backed fake in tests). Used by
``towers.process_group`` (processes joining a process group) and by ``towers launch`` (nodes
joining a multi-node job), so both say the same things:

- ``resolve`` fails at once, in one line, when the rendezvous host name does not resolve;
- ``wait_reachable`` waits while the rendezvous port refuses connections (its owner has not
  started yet), reporting whom it waits for, and fails at once when the host is unreachable
  (no route, or a connection attempt that times out: a firewall or a wrong address);
- ``join`` records this member (host name, address, pid) and waits until every member has joined.
  The chief reports every ``report_interval_s`` who joined and who is missing, and at the join
  timeout says what was awaited, since when, and what to check, in one line. The others wait for
  the chief's verdict, so every member stops with the same message.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from towers.errors import TowersError

__all__ = [
    "RendezvousError",
    "JoinTimeoutError",
    "Member",
    "KeyValueStore",
    "report_interval_s",
    "resolve",
    "wait_reachable",
    "join",
    "JOIN_HINT",
    "visible_warning",
    "bound_listener",
]

#: What to check when members are missing; ends every join-timeout message.
JOIN_HINT = ("Check that every process of the job was started with the same cluster description, that each "
             "host can reach the rendezvous address (firewall; the network interface: towers launch --interface "
             "or GLOO_SOCKET_IFNAME), or allow more time: towers launch --join-timeout SECONDS, or "
             "TOWERS_JOIN_TIMEOUT_S.")

_POLL_S = 0.25
_PROBE_TIMEOUT_S = 3.0


class RendezvousError(TowersError, RuntimeError):
    """The rendezvous cannot happen (bad host, unreachable address, members missing); the message is one line."""


class JoinTimeoutError(RendezvousError):
    """Some members did not join before the join timeout; ``missing`` holds their indices."""

    def __init__(self, message: str, missing: Sequence[int] = ()):
        super().__init__(message)
        self.missing = tuple(missing)


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` that ``join`` uses (``get`` only after ``check`` found the key)."""

    def set(self, key: str, value: Any) -> None: ...  # noqa: D102

    def check(self, keys: list[str]) -> bool: ...  # noqa: D102

    def get(self, key: str) -> bytes: ...  # noqa: D102

    def add(self, key: str, amount: int) -> int: ...  # noqa: D102


@dataclass(frozen=True)
class Member:
    """What a member recorded when it joined: where it runs."""

    host: str
    address: str
    pid: int
    #: where ``pid`` means something (``towers.cluster.deaths.pid_scope``); ``""``: unknown
    scope: str = ""

    def __str__(self) -> str:
        return f"host {self.host} {self.address}, pid {self.pid}" if self.address else f"host {self.host}, pid {self.pid}"


def visible_warning(logger: logging.Logger, *, prefix: str = "towers:",
                    level: int = logging.WARNING) -> Callable[[str], None]:
    """Return a ``report`` that logs a waiting line at ``level``, and prints it to stderr when nothing would show it.

    The library's ``NullHandler`` keeps Python from printing warnings of an application that set up
    no logging; a process waiting for its peers must still say so. So, when no handler on the
    logger's way would emit a WARNING, the line goes to stderr as ``prefix message``.
    """

    def shown() -> bool:
        current: logging.Logger | None = logger
        while current is not None:
            if any(not isinstance(h, logging.NullHandler) and h.level <= level for h in current.handlers):
                return True
            current = current.parent if current.propagate else None
        return False

    def report(message: str) -> None:
        if not logger.isEnabledFor(level):
            return
        if shown():
            logger.log(level, message)
        else:
            sys.stderr.write(f"{prefix} {message}\n")
            sys.stderr.flush()

    return report


def report_interval_s(timeout_s: float) -> float:
    """Return how often a waiting process reports: every 15 s, more often when the timeout is short."""
    return min(15.0, max(1.0, timeout_s / 4))


def _clock_text(wall: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(wall))


def resolve(host: str, port: int, *, what: str) -> list[str]:
    """Return the addresses ``host`` resolves to.

    ``what`` names where the host came from, for the message (e.g. ``"MASTER_ADDR"``).

    Raises:
        RendezvousError: at once, when the name does not resolve.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise RendezvousError(
            f"the rendezvous host {host!r} ({what}) does not resolve to an address: {reason}. Check the spelling, "
            "use the chief's IP address, or add the name to DNS or /etc/hosts on this host.") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def bound_listener(host: str, port: int) -> tuple[int, str] | None:
    """Return ``(fd, address)`` of a listening socket on ``host``'s own address and ``port``, or None.

    torch's ``TCPStore`` server listens on every interface (``*:port``, IPv4 and IPv6) unless it is
    handed a listening socket (``master_listen_fd``); this makes that socket, bound to the first
    address ``host`` resolves to, so the store is reachable only where the job said it is
    (loopback for a one-host job). The caller owns ``fd`` (``TCPStore`` takes it over). None when
    ``host`` does not resolve to an address of this host (a name that points elsewhere, e.g. a
    service address): the store then listens as torch makes it.

    Raises:
        OSError: when the address is this host's but ``port`` cannot be bound (e.g. in use).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                sock.close()
                return None
            raise
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock.detach(), str(sockaddr[0])


def wait_reachable(host: str, port: int, *, timeout_s: float, what: str, awaited: str,
                   report: Callable[[str], None], since: float | None = None, source_address: str | None = None,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   connect: Callable[..., socket.socket] = socket.create_connection) -> str:
    """Wait until ``host:port`` accepts a TCP connection; return this host's address on that route.

    A refused connection means the owner of the rendezvous (``awaited``, e.g. "the chief (rank 0)")
    has not started yet: wait, reporting every ``report_interval_s(timeout_s)``, up to ``timeout_s``.
    ``source_address`` (the address of the job's chosen network interface) is where the attempts
    leave from, so an interface that cannot reach the rendezvous fails here, at once.

    Raises:
        RendezvousError: at once for an unresolvable name or an unreachable host (no route, or a
            connection attempt timing out), and at ``timeout_s`` while still refused (a
            ``JoinTimeoutError``); one line each.
    """
    resolve(host, port, what=what)
    start, wall_start = clock(), time.time() if since is None else since
    interval = report_interval_s(timeout_s)
    next_report = start + interval
    while True:
        remaining = timeout_s - (clock() - start)
        try:
            with connect((host, port), timeout=min(_PROBE_TIMEOUT_S, max(remaining, 0.1)),
                         source_address=(source_address, 0) if source_address else None) as sock:
                return str(sock.getsockname()[0])
        except ConnectionRefusedError:
            pass
        except (socket.timeout, TimeoutError):
            raise RendezvousError(
                f"the rendezvous {host}:{port} ({what}) did not answer within {_PROBE_TIMEOUT_S:g} s: the host is "
                "unreachable from here (a firewall dropping the connection, or a wrong address). Check the address "
                "and that the port is open between the hosts.") from None
        except OSError as exc:
            if source_address and exc.errno == errno.EADDRNOTAVAIL:
                raise RendezvousError(
                    f"cannot reach the rendezvous {host}:{port} ({what}) from {source_address}, the address of the "
                    f"job's network interface: {exc.strerror or exc}. Choose the interface that reaches it "
                    "(towers launch --interface NAME, TOWERS_INTERFACE or GLOO_SOCKET_IFNAME).") from None
            if exc.errno not in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.ECONNRESET):
                raise RendezvousError(f"cannot connect to the rendezvous {host}:{port} ({what}): {exc.strerror or exc}. "
                                      "Check the address and the network.") from None
            raise RendezvousError(
                f"the rendezvous {host}:{port} ({what}) is unreachable from this host: {exc.strerror or exc}. Check "
                "the address, the route between the hosts, and the network interface (towers launch --interface "
                "or GLOO_SOCKET_IFNAME).") from None
        now = clock()
        waited = now - start
        if waited >= timeout_s:
            raise JoinTimeoutError(
                f"{awaited} did not open the rendezvous {host}:{port} ({what}) within the join timeout of "
                f"{timeout_s:g} s (connections refused since {_clock_text(wall_start)}). {JOIN_HINT}")
        if now >= next_report:
            report(f"waiting for {awaited} to open the rendezvous {host}:{port} ({what}): connection refused for "
                   f"{waited:.0f} s of the {timeout_s:g} s join timeout")
            next_report = now + interval
        sleep(_POLL_S)


def _record(store: KeyValueStore, key: str) -> Member | None:
    if not store.check([key]):
        return None
    try:
        data = json.loads(store.get(key))
        return Member(host=str(data["host"]), address=str(data.get("address", "")), pid=int(data["pid"]),
                      scope=str(data.get("scope", "")))
    except (ValueError, KeyError, TypeError):
        return Member(host="?", address="", pid=0)


def _plural(kind: str) -> str:
    return kind + ("es" if kind.endswith("s") else "s")


def _status(joined: Mapping[int, Member], count: int, describe: Callable[[int], str]) -> str:
    present = "; ".join(f"{describe(i)} [{m}]" for i, m in sorted(joined.items())) or "none"
    missing = ", ".join(describe(i) for i in range(count) if i not in joined) or "none"
    return f"joined: {present}; missing: {missing}"


class _ArrivalLog:
    """Members in the order they arrived, read from where the last read stopped: O(1) store calls per poll and
    O(1) per member in all, so a rendezvous of N members costs O(N) store calls, not O(N) per member per poll.

    ``name`` is the log (``"all"``, or one pid scope's: the members on one host)."""

    def __init__(self, store: KeyValueStore, name: str):
        self.store, self.name, self.read = store, name, 0

    def append(self, index: int) -> None:
        position = self.store.add(f"join/log/{self.name}/n", 1)
        self.store.set(f"join/log/{self.name}/{position}", str(index))

    def new(self) -> list[int]:
        """The members that arrived since the last call (one ``add`` when none did)."""
        arrived = self.store.add(f"join/log/{self.name}/n", 0)
        found = []
        while self.read < arrived:
            key = f"join/log/{self.name}/{self.read + 1}"
            if not self.store.check([key]):  # counted, not written yet: read it at the next poll
                break
            found.append(int(self.store.get(key)))
            self.read += 1
        return found


def announce(store: KeyValueStore, *, index: int, me: Member, describe: Callable[[int], str], where: str = "",
             kind: str = "process") -> None:
    """What member ``index`` writes to join (``join`` calls it first): its claim on the index, its record, and its
    place in the arrival logs (all members', and its pid scope's).

    Raises:
        RendezvousError: when another member already claimed ``index``.
    """
    claims = store.add(f"join/claims/{index}", 1)
    if claims > 1:
        raise RendezvousError(
            f"two {kind}s claim to be {describe(index)} at the rendezvous {where}: each {kind} needs its own rank "
            f"(this one: {me}). Give every {kind} a different rank (--node-rank, RANK, TF_CONFIG's task index).")
    store.set(f"join/member/{index}",
              json.dumps({"host": me.host, "address": me.address, "pid": me.pid, "scope": me.scope}))
    _ArrivalLog(store, "all").append(index)
    if me.scope:
        _ArrivalLog(store, f"scope/{me.scope}").append(index)


def join(store: KeyValueStore, *, index: int, count: int, is_chief: bool, timeout_s: float, where: str,
         describe: Callable[[int], str], report: Callable[[str], None], me: Member | None = None,
         kind: str = "process", since: float | None = None, waited_s: float = 0.0,
         dead: Callable[[Mapping[int, Member]], str | None] | None = None,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> dict[int, Member]:
    """Record member ``index`` of ``count`` in ``store`` and return every member once all have joined.

    The chief reports progress through ``report`` every ``report_interval_s(timeout_s)`` and, at
    ``timeout_s``, tells the others why it gives up; ``describe(i)`` names member ``i`` and
    ``where`` the rendezvous (for the messages); ``kind`` is "process" or "node". ``waited_s`` is
    how much of ``timeout_s`` was spent before (reaching the store); ``since`` the wall time it began.
    ``dead(joined)``, polled while waiting, returns a line naming a member that died (or None): the
    wait then ends at once with it, on the chief's verdict for everyone.

    The chief reads each member's record once, as it arrives, and returns them all; another member
    waits for the chief's verdict and reads only the members of its own pid scope (its host: what
    ``dead`` can judge), which it returns. Each poll costs O(1) store calls (``_ArrivalLog``).

    Raises:
        JoinTimeoutError: when members are still missing at ``timeout_s``: one line naming them,
            the members that joined, since when, and what to check.
        RendezvousError: when two members claim the same index, or ``dead`` named a dead member.
    """
    me = me or Member(host=socket.gethostname(), address="", pid=os.getpid())
    announce(store, index=index, me=me, describe=describe, where=where, kind=kind)
    everyone = _ArrivalLog(store, "all")
    neighbours = _ArrivalLog(store, f"scope/{me.scope}") if me.scope else None
    start, wall_start = clock() - waited_s, time.time() - waited_s if since is None else since
    interval = report_interval_s(timeout_s)
    next_report = start + interval
    joined: dict[int, Member] = {}
    # Each poll is O(1) store calls (about 2), but N members polling are N of them: members back off to one poll per
    # count / 2048 s (at most 4096 calls/s on the store whatever N; the verdict is seen up to 8 s late at 16k).
    poll_s, most_s = _POLL_S, max(_POLL_S, count / 2048)
    while True:
        log = everyone if is_chief else neighbours
        for i in log.new() if log is not None else []:
            joined[i] = _record(store, f"join/member/{i}") or Member("?", "", 0)
        if is_chief and len(joined) == count:
            store.set("join/verdict", "complete")
            return joined
        if not is_chief and store.check(["join/verdict"]):
            verdict = store.get("join/verdict").decode(errors="replace")
            if verdict == "complete":
                return {**joined, index: me}
            raise JoinTimeoutError(verdict, [i for i in range(count) if _record(store, f"join/member/{i}") is None])
        death = dead(joined) if dead is not None else None
        if death is not None:
            if is_chief:
                store.set("join/verdict", death)
            raise RendezvousError(death)
        now = clock()
        waited = now - start
        # The others give the chief a moment past their own deadline, so that they end with its message.
        if waited >= timeout_s + (0.0 if is_chief else min(5.0, timeout_s / 2)):
            if not is_chief:  # once, at the end: which members the chief never confirmed
                joined = {i: m for i in range(count) if (m := _record(store, f"join/member/{i}")) is not None}
            missing = [i for i in range(count) if i not in joined]
            message = (f"{len(missing)} of {count} {_plural(kind)} did not join the rendezvous at {where} within the "
                       f"join timeout of {timeout_s:g} s (waiting since {_clock_text(wall_start)}); "
                       f"{_status(joined, count, describe)}. {JOIN_HINT}")
            if is_chief:
                store.set("join/verdict", message)
            raise JoinTimeoutError(message, missing)
        if is_chief and now >= next_report:
            report(f"waiting for {count - len(joined)} of {count} {_plural(kind)} to join "
                   f"the rendezvous at {where} ({waited:.0f} s of the {timeout_s:g} s join timeout, since "
                   f"{_clock_text(wall_start)}): {_status(joined, count, describe)}")
            next_report = now + interval
        sleep(poll_s)
        poll_s = min(poll_s * 2, most_s)
