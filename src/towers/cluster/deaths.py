"""A process that dies during start-up is named by the others at once, instead of a silent wait for a timeout.

Between a member's rendezvous record and the end of start-up (the process group created and,
under parameter servers, the worker <-> ps links opened) the others block in calls that cannot
see a peer's death: Gloo waits in the store for the dead peer's address up to the collective
timeout. A ``StartupWatch`` thread looks instead, every ``poll_s``:

- on this host (same boot and pid namespace: ``pid_scope``), whether each member's recorded pid
  is still alive (``os.kill(pid, 0)``; a zombie counts as dead), unless that member noted in the
  store that its own start-up had finished (``finish``: it may end early, legitimately);
- across hosts, whether a ``dead/<rank>`` key appeared in the job's store: the supervisor of a
  process (``towers launch --strategy ps``) publishes it when its child dies before the job
  started (``publish_death``).

On the first death it records one line naming the dead member (``failure``); a caller blocked in
C++ that does not return within ``grace_s`` is ended with that line and exit code 1 (nothing
else can interrupt it). Every ``report_interval_s`` it says what start-up still waits for.
Torch-free: the store is anything with ``set``, ``check``, ``get`` and ``add``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Mapping

from towers.cluster.rendezvous import KeyValueStore, Member, report_interval_s

__all__ = ["pid_scope", "process_gone", "publish_death", "read_deaths", "StartupWatch"]

_COUNT_KEY = "dead/count"
_STARTED = "started/"


def pid_scope() -> str:
    """Return what makes pids comparable: this boot and pid namespace (Linux), else ``""`` (never compare)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_gone(pid: int) -> bool:
    """True when no live process has ``pid`` here (it never existed, exited, or is a zombie nobody reaped yet)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, another user's
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def publish_death(store: KeyValueStore, index: int, description: str) -> None:
    """Tell the members waiting in start-up that member ``index`` died (``description``: how, e.g. its exit code)."""
    store.set(f"dead/{index}", description)
    store.add(_COUNT_KEY, 1)


def read_deaths(store: KeyValueStore, count: int) -> dict[int, str]:
    """Return ``{index: description}`` of the members of ``count`` published dead (one store round-trip when none)."""
    if store.add(_COUNT_KEY, 0) <= 0:
        return {}
    deaths = {}
    for i in range(count):
        if store.check([f"dead/{i}"]):
            deaths[i] = store.get(f"dead/{i}").decode(errors="replace")
    return deaths


class StartupWatch:
    """A thread that names the first member to die during start-up (see the module docstring).

    ``describe(i)`` names member ``i``; ``report(line)`` shows a waiting line, ``report_death(line)``
    the death (default ``report``); ``store_factory`` (or ``set_store_factory``) opens this thread's
    own store client (the main thread's may be held in a long wait): without one nothing is judged,
    as a member that finished its start-up cannot be told from a dead one. ``exit_process`` ends a
    caller still blocked ``grace_s`` after a death (``os._exit`` by default).
    """

    def __init__(self, *, index: int, count: int, describe: Callable[[int], str], report: Callable[[str], None],
                 store_factory: Callable[[], KeyValueStore] | None, timeout_s: float,
                 report_death: Callable[[str], None] | None = None, scope: str | None = None,
                 poll_s: float = 0.25, grace_s: float = 2.0,
                 exit_process: Callable[[int], object] = os._exit):
        self.index, self.count, self._describe, self._report = index, count, describe, report
        self._report_death = report_death or report
        self._store_factory, self._timeout_s = store_factory, timeout_s
        self._scope = pid_scope() if scope is None else scope
        self._poll_s, self._grace_s, self._exit = poll_s, grace_s, exit_process
        self._members: dict[int, Member] = {}
        self._finished: set[int] = set()  # members whose own start-up is over (read in the thread only)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.phase = "joining the rendezvous"  # join reports its own progress; the watch reports later phases
        self._phase_since: float | None = None
        self.failure: str | None = None
        self.dead_index: int | None = None

    def watch(self, members: Mapping[int, Member]) -> None:
        """Watch ``members`` too (their pids, when on this host); starts the thread on the first call."""
        with self._lock:
            self._members.update(members)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="towers-startup-watch", daemon=True)
            self._thread.start()

    def set_store_factory(self, store_factory: Callable[[], KeyValueStore]) -> None:
        """Say how the thread opens its store client (before the first ``watch``: the store may not exist before)."""
        self._store_factory = store_factory

    def set_phase(self, phase: str) -> None:
        """Say what start-up does now (e.g. "connecting worker 1 <-> ps task 0"): the waiting lines name it."""
        self.phase, self._phase_since = phase, time.monotonic()

    def finish(self, store: KeyValueStore) -> None:
        """Note in ``store`` that this member's start-up is over (its later exit is no start-up death), and stop."""
        store.set(f"{_STARTED}{self.index}", "1")
        self.stop()

    def stop(self, *, wait_s: float = 0.0) -> None:
        """End the watch (start-up is over, or failed in this thread first); idempotent.

        Waits up to ``wait_s`` for the thread to end (by default not at all: it may be in a slow store call);
        once stopped it reports and ends nothing. A process about to exit on a start-up error waits a moment, so
        that the thread's store client is closed by the thread, not torn down at exit under a store call.
        """
        self._stop.set()
        thread = self._thread
        if wait_s > 0 and thread is not None and thread is not threading.current_thread():
            thread.join(wait_s)

    def _dead(self, store: KeyValueStore | None) -> tuple[int, str] | None:
        with self._lock:
            members = dict(self._members)
        if store is None:  # without the store a finished member cannot be told from a dead one
            return None
        for i, member in sorted(members.items()):
            if i == self.index or i in self._finished or not self._scope or member.scope != self._scope:
                continue
            if process_gone(member.pid):
                if store.check([f"{_STARTED}{i}"]):  # it finished its start-up, then ended: not ours to judge
                    self._finished.add(i)
                    continue
                return i, f"its process, pid {member.pid} on host {member.host}, is gone"
        for i, description in sorted(read_deaths(store, self.count).items()):
            if i != self.index:
                return i, description
        return None

    def _run(self) -> None:
        store = None
        if self._store_factory is not None:
            try:
                store = self._store_factory()
            except Exception:  # noqa: BLE001 - no store client: start-up waits as it would without the watch
                store = None
        interval = report_interval_s(self._timeout_s)
        reported: tuple[float | None, float] = (None, 0.0)  # (phase start, last report)
        while not self._stop.wait(self._poll_s):
            try:
                dead = self._dead(store)
            except Exception:  # noqa: BLE001 - the store went away (its host stopped): the job is ending anyway
                store, dead = None, None
            if dead is not None and not self._stop.is_set():
                i, how = dead
                self.dead_index = i
                self.failure = (f"{self._describe(i)} died during start-up ({how}) while this process was "
                                f"{self.phase}; the job cannot start without it. Look for the first error in "
                                f"{self._describe(i)}'s output.")
                if not self._stop.wait(self._grace_s):  # the caller is blocked where only an exit ends it
                    self._report_death(f"{self.failure} This process stops.")
                    self._exit(1)
                return
            since, now = self._phase_since, time.monotonic()
            if since is None or self._stop.is_set():
                continue
            last = reported[1] if reported[0] == since else since
            if now - last >= interval:
                with self._lock:
                    watched = len(self._members)
                self._report(f"still {self.phase} after {now - since:.0f} s; {watched} of {self.count} processes "
                             "recorded, none known dead")
                reported = (since, now)
