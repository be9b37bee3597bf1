"""What this process is doing now: the towers call it is in, its collective sequence, its step times.

``track(kind)`` wraps every towers call site that blocks on other processes (a collective of the
synchronous strategies, a request to the parameter servers). torch's flight recorder adds what
towers does not call itself (DDP's gradient all-reduce, FSDP's collectives): the sequence number
and kind of the last collective on the default process group, and whether it completed.
``snapshot()`` combines both into one JSON-ready record, which the watchdog publishes.

The state is per process (as the process group and the flight recorder are): a process is one
replica and has one watchdog.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
from typing import Any, Callable

__all__ = ["Progress", "PROGRESS", "track", "set_role", "flight_recorder_position", "enable_flight_recorder",
           "FLIGHT_RECORDER_ENTRIES", "group_ranks"]

#: Collectives torch's flight recorder keeps (``TORCH_FR_BUFFER_SIZE`` when the user set none).
FLIGHT_RECORDER_ENTRIES = 256

#: How many recent steps (optimizer updates) the bound looks at.
RECENT_STEPS = 20
#: Without optimizer steps, this many intervals between towers calls stand in for step times.
MIN_CALL_GAPS = 8


class Progress:
    """This process's progress: towers calls entered, the one it is in (if any), optimizer steps."""

    def __init__(self) -> None:
        self.role = "worker"
        self.calls = 0  # outermost towers calls entered
        self.last_call: str | None = None  # the kind of the last outermost one
        self.stack: list[str] = []  # the towers calls it is in now, outermost first
        self.open_since: float | None = None  # wall time the outermost open call began
        self.steps = 0
        self._last_step: float | None = None
        self.step_times: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._last_call: float | None = None
        self.call_gaps: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS * 4)
        #: The collective every replica must call that this process is in now (a ``named.NamedCall``), and how
        #: many such calls it entered: the same count on every replica of a correct program.
        self.named: Any = None
        self.named_calls = 0

    def enter(self, kind: str) -> None:
        """Record that this process entered the towers call ``kind`` (nested calls refine the kind)."""
        if not self.stack:
            now = time.time()
            self.calls += 1
            self.last_call = kind
            self.open_since = now
            if self._last_call is not None:
                self.call_gaps.append(now - self._last_call)
            self._last_call = now
        self.stack.append(kind)

    def exit(self) -> None:
        """Record that the innermost open towers call returned (or raised)."""
        if self.stack:
            self.stack.pop()
        if not self.stack:
            self.open_since = None

    def on_step(self, *_: Any) -> None:
        """Count one optimizer update and its duration (registered as torch's global step post-hook)."""
        now = time.monotonic()
        if self._last_step is not None:
            self.step_times.append(now - self._last_step)
        self._last_step = now
        self.steps += 1

    def slowest_recent_step_s(self) -> float | None:
        """Return the longest of the recent steps, or None while none was measured.

        Without optimizer steps (a loop of collectives only), the longest recent interval between two
        towers calls stands in for the step time, once there are a few of them.
        """
        if self.step_times:
            return max(self.step_times)
        return max(self.call_gaps) if len(self.call_gaps) >= MIN_CALL_GAPS else None


PROGRESS = Progress()


class track:
    """Context manager around one blocking towers call: ``with track("strategy.barrier"): ...``."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __enter__(self) -> None:
        PROGRESS.enter(self.kind)

    def __exit__(self, *exc: Any) -> None:
        PROGRESS.exit()


def set_role(role: str) -> None:
    """Name this process's role in reports (``"worker"``, ``"ps"``); a ps task serves and never waits itself."""
    PROGRESS.role = role


def enable_flight_recorder(info: Any = None, entries: int = FLIGHT_RECORDER_ENTRIES) -> None:
    """Turn torch's flight recorder on for the process groups created from now on (unless the user sized it).

    torch reads ``TORCH_FR_BUFFER_SIZE`` when the first process group is created; this only sets it
    when absent, so a user's own value (``0`` turns the recorder off) wins. Nothing is done for a
    ``ProcessInfo`` whose watchdog is off (``stuck_timeout_s == 0``) or that has no peers.
    """
    if info is not None and (info.world_size < 2 or info.stuck_timeout_s == 0):
        return
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(int(entries)))


def _read_flight_recorder() -> list[dict[str, Any]]:
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - a torch without the recorder
        return []
    try:
        raw = _dump_fr_trace_json(True, False)
    except Exception:  # noqa: BLE001 - diagnostics must never fail the job
        return []
    return list(json.loads(raw).get("entries", []))


def flight_recorder_position(read: Callable[[], list[dict[str, Any]]] = _read_flight_recorder) -> dict[str, Any] | None:
    """Return the last collective of the default process group in torch's flight recorder, or None.

    ``{"seq": n, "kind": "all_reduce", "done": bool, "since": wall time the oldest unfinished one
    was issued, "pending_seq", "pending_kind", "sizes"}``; ``done`` is False while a collective of
    any group (a sub-group of a device mesh too) has not completed. Sequence numbers are the default
    group's (the one every rank shares). Point-to-point traffic (``monitored_barrier``, the
    parameter-server links, which wait for requests by design) has its own numbering and is left out.
    """
    entries = [e for e in read() if not e.get("is_p2p")]
    if not entries:
        return None
    default = [e for e in entries if _group(e) == "0"] or entries
    last = max(default, key=lambda e: int(e.get("collective_seq_id", 0)))
    pending = [e for e in entries if not e.get("retired", True)]
    oldest = min(pending, key=lambda e: int(e.get("time_created_ns", 0))) if pending else last
    return {"seq": int(last.get("collective_seq_id", 0)),
            "kind": _kind(last),
            "done": not pending,
            "since": int(oldest.get("time_created_ns", 0)) / 1e9,
            "pending_seq": int(oldest.get("collective_seq_id", 0)) if pending else None,
            "pending_kind": _kind(oldest) if pending else None,
            "pending_group": _group(oldest) if pending else None,
            "sizes": last.get("input_sizes")}


def group_ranks(name: str | None) -> list[int] | None:
    """Return the global ranks of this process's process group named ``name`` (the flight recorder's), or None."""
    try:
        import torch.distributed.distributed_c10d as c10d

        for group, group_name in c10d._world.pg_names.items():
            if group_name == name:
                return sorted(c10d._world.pg_group_ranks[group])
    except Exception:  # noqa: BLE001 - diagnostics must never fail the job
        return None
    return None


def _group(entry: dict[str, Any]) -> str:
    return str((entry.get("process_group") or ["0", ""])[0])


def _kind(entry: dict[str, Any]) -> str:
    kind = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    group = entry.get("process_group") or ["0", ""]
    return kind if _group(entry) == "0" else f"{kind} on group {group[-1] or group[0]}"


def snapshot(*, rank: int, bound_s: float, progress: Progress = PROGRESS,
             recorder: Callable[[], dict[str, Any] | None] = flight_recorder_position) -> dict[str, Any]:
    """Return this process's progress as JSON-ready data (what the watchdog publishes every beat).

    ``waiting`` is true while the process is inside a towers call or an unfinished collective;
    ``since`` is when that wait began (wall time).
    """
    fr = recorder()
    open_since = progress.open_since
    waits = [t for t in (open_since, None if fr is None or fr["done"] else fr["since"]) if t is not None]
    return {
        "rank": rank, "role": progress.role, "pid": os.getpid(), "host": socket.gethostname(),
        "time": time.time(), "steps": progress.steps, "step_s": progress.slowest_recent_step_s(),
        "bound_s": bound_s, "calls": progress.calls, "call": " > ".join(progress.stack) or None,
        "last_call": progress.last_call,
        "waiting": bool(waits), "since": min(waits) if waits else None, "collective": fr,
        "threads": threading.active_count(),
    }
