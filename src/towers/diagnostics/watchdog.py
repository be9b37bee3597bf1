"""The watchdog: a thread per process that ends a stuck job within a bound, with a report naming the stuck rank.

Every ``poll_s`` each process looks at its own waits (no store traffic). Every ``check_s`` it
asks the job's rendezvous store whether ``abort`` was set, and every ``beat_s`` it publishes a
heartbeat (its ``progress.snapshot``) there: 0.13 store operations per second per process with
the defaults (``check_s`` 10 s, ``beat_s`` 30 s), whatever the number of processes: 16,384
processes cost one store about 2,200 operations per second. When one process has waited in a single collective (or
parameter-server request) longer than its bound, ``max(min_s, factor x the slowest recent step)``,
it takes the reporter's role (the first to increment the store's ``trigger`` key) and sets
``abort``. Every watchdog sees ``abort`` within ``check_s``, answers with its own Python stacks
and position, then exits with ``STUCK_EXIT_CODE``. The reporter waits ``answer_s`` for the answers, writes one report (a file,
and the log of the reporter and the chief) and exits too. A rank that does not answer is stopped
(SIGSTOP) or hung in C code holding the GIL: the report says so, from its last heartbeat; its
launcher (``towers launch``, torchrun) ends it once the others have exited.

No rank needs to be healthy: the store is the job's own (hosted by the launcher's agent, or by rank
0). When the store does not answer, a waiting process writes a report of its own and exits.

A collective every replica must call (``Metric.result()``) that one replica did not call is not a hang to
report: ``named_watch.NamedWatch`` finds it within seconds and the watchdog ends that replica with the error (exit 1).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.diagnostics import progress as _progress
from towers.diagnostics.named import ABORT_KEY, describe, take_verdict
from towers.diagnostics.named_watch import NamedWatch
from towers.diagnostics.report import STUCK_EXIT_CODE, build_report
from towers.errors import DeadlineExceededError, InvalidArgumentError

__all__ = ["Watchdog", "python_stacks", "DEFAULT_MIN_S", "DEFAULT_FACTOR", "STARTUP_FACTOR", "CHECK_S", "PS_CHECK_S",
           "BEAT_S"]

log = get_logger(__name__)

#: The least time a rank may wait in one collective before the job is ended (``TOWERS_STUCK_TIMEOUT_S``).
DEFAULT_MIN_S = 60.0
#: The bound is at least this many times the slowest recent step.
DEFAULT_FACTOR = 10.0
#: Before the first steps are measured, the bound is this many times the least bound.
STARTUP_FACTOR = 5.0
#: The longest interval between two looks at the store's ``abort`` key (shorter when ``answer_s`` is).
CHECK_S = 10.0
#: The same for a parameter-server task: few of them, and no wait of their own by which to notice that the job ended.
PS_CHECK_S = 2.0
#: The longest interval between two heartbeats (shorter when ``min_s`` is): a heartbeat is read only
#: for a rank that does not answer, to say where it was.
BEAT_S = 30.0

def _say(text: str) -> None:
    """Log ``text`` at ERROR; straight to stderr when the application routes no towers log line anywhere.

    These are the last words of a process the watchdog is about to end (like ``faulthandler``'s):
    they must reach the user even from a script that never configured logging.
    """
    logger: logging.Logger | None = log
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            log.error("%s", text)
            return
        logger = logger.parent if logger.propagate else None
    sys.stderr.write(text if text.endswith("\n") else text + "\n")


def python_stacks(skip: int | None = None) -> str:
    """Return every thread's Python stack (main thread first), leaving out thread ``skip``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    main = threading.main_thread().ident
    parts = []
    for ident in sorted(frames, key=lambda i: (i != main, names.get(i, ""))):
        if ident == skip:
            continue
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


class Watchdog:
    """Watch this process's waits; end the whole job, with a report, when one exceeds the bound."""

    def __init__(self, info: ProcessInfo, store: Any, *, min_s: float = DEFAULT_MIN_S,
                 factor: float = DEFAULT_FACTOR, poll_s: float | None = None, answer_s: float | None = None,
                 report_dir: str | os.PathLike[str] | None = None,
                 progress: _progress.Progress = _progress.PROGRESS,
                 exit: Callable[[int], Any] = os._exit, hold_main_thread: bool = True):
        if not min_s > 0:
            raise InvalidArgumentError(f"min_s must be > 0 seconds. Received: {min_s}.")
        if not factor > 0:
            raise InvalidArgumentError(f"factor must be > 0. Received: {factor}.")
        self.info, self.store, self.min_s, self.factor = info, store, float(min_s), float(factor)
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, self.min_s / 10))
        self.answer_s = answer_s if answer_s is not None else min(20.0, max(2.0, self.min_s / 3))
        # The store is shared by every rank of the job: each rank's own traffic is a few operations a
        # minute, not per second. Every rank sees "abort" within check_s, well inside the answer window.
        self.check_s = max(self.poll_s, min(PS_CHECK_S if progress.role == "ps" else CHECK_S, self.answer_s / 2))
        self.beat_s = max(self.poll_s, min(BEAT_S, self.min_s / 2))
        self._next_check = self._next_beat = 0.0
        self._backoff_s = max(0.02, self.poll_s / 4)
        self.report_dir = Path(report_dir) if report_dir is not None else Path(tempfile.gettempdir())
        self.progress = progress
        self._exit, self._hold = exit, hold_main_thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="towers-watchdog", daemon=True)
        self.report_path: Path | None = None
        self.report: str | None = None
        self._named = NamedWatch(rank=info.rank, world_size=info.world_size, store=store, progress=progress,
                                 poll_s=self.poll_s, check_s=self.check_s)
        self._took_verdict = False

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        """Start the thread (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (idempotent); a report already under way still ends the process."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.poll_s * 4 + 1.0)

    def bound_s(self) -> float:
        """Return how long one wait may last now: ``max(min_s, factor x the slowest recent step)``.

        Before any step was measured it is ``STARTUP_FACTOR x min_s``: at start-up a rank may wait in a
        barrier while the chief downloads or prepares data, which no step time yet bounds.
        """
        step = self.progress.slowest_recent_step_s()
        return self.min_s * STARTUP_FACTOR if step is None else max(self.min_s, self.factor * step)

    def snapshot(self) -> dict[str, Any]:
        """Return this process's heartbeat: its progress, position and bound."""
        snap = _progress.snapshot(rank=self.info.rank, bound_s=self.bound_s(), progress=self.progress)
        snap.update(min_s=self.min_s, factor=self.factor, startup_factor=STARTUP_FACTOR)
        return snap

    # --- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.tick(time.monotonic()) and not self._stop.wait(self.poll_s):  # the first beat at once
            pass

    def tick(self, now: float) -> bool:
        """Do one poll at monotonic time ``now``: beat and check ``abort`` when due, act on a wait past its bound.

        Returns True once this watchdog has ended its work (the process exits, or ``exit`` was called).
        The thread calls it every ``poll_s``; a simulation drives it directly.
        """
        snap = self.snapshot()
        error = self._named.tick(time.time(), snap, self._hold_main_thread)
        if error is not None:  # this rank waits for a replica in a call it never made: an error, not a hang
            _say(f"PartialCollectiveError: {error}")
            self.take_verdict()
            self._finish(1)
            return True
        overdue = bool(snap["waiting"]) and time.time() - float(snap["since"]) > float(snap["bound_s"])
        aborted, store_error = False, None
        try:
            if now >= self._next_beat:
                self.store.set(f"beat/{self.info.rank}", json.dumps(snap))
                self._next_beat = now + self.beat_s
            if now >= self._next_check or overdue:
                aborted = self.store.check([ABORT_KEY])
                self._next_check = now + self.check_s
        except Exception as exc:  # noqa: BLE001 - a store that went away (job end, stopped host) is data
            store_error = exc
        if aborted:
            self._hold_main_thread()
            error = self._verdict()
            if error is not None:  # not a hang: a replica missing from a collective every replica must call
                _say(f"PartialCollectiveError: {error}")
                self.take_verdict()
                self._finish(1)
            else:
                self._answer_and_exit()
            return True
        if not overdue:
            return False
        if store_error is not None:
            self._hold_main_thread()
            self._local_report(snap, store_error)
            return True
        try:
            elected = self.store.add("trigger", 1) == 1
        except Exception as exc:  # noqa: BLE001
            self._hold_main_thread()
            self._local_report(snap, exc)
            return True
        if elected:
            self._hold_main_thread()
            self._report(snap)
            return True
        return False  # another rank reports: its "abort" is seen on the next poll (an overdue rank checks each one)

    def take_verdict(self) -> None:
        """Count this process among those that took the job's verdict (``named.take_verdict``; once per process)."""
        if not self._took_verdict:
            self._took_verdict = True
            take_verdict(self.store, hosts_store=self.info.rank == 0 and not self.info.agent_store,
                         world_size=self.info.world_size)

    def _verdict(self) -> str | None:
        """Return the error an ``abort`` carries (``named.py``'s verdict, told as this rank), or None: a stuck job."""
        try:
            verdict = json.loads(self.store.get(ABORT_KEY)).get("verdict")
        except Exception:  # noqa: BLE001 - unreadable: answer as to a stuck job
            return None
        return None if verdict is None else describe(verdict, self.info.rank, self.info.world_size)

    def _hold_main_thread(self) -> None:
        """Keep the main thread from ending the process first while this watchdog ends it.

        Once one rank exits, the others' collectives fail: their main threads raise and would exit
        with a traceback and code 1 before their watchdogs exit with the report's code. An uncaught
        exception (``sys.excepthook``) or an exit (``atexit``) now waits for the watchdog instead.
        """
        if not self._hold:
            return
        previous = sys.excepthook
        limit_s = self.answer_s + 15.0

        def wait_for_watchdog(*args: Any) -> None:
            time.sleep(limit_s)  # the watchdog's os._exit ends the process long before
            if args:
                previous(*args)

        sys.excepthook = wait_for_watchdog
        atexit.register(wait_for_watchdog)

    def _answer(self) -> None:
        self.store.set(f"answer/{self.info.rank}",
                       json.dumps({"snap": self.snapshot(), "stack": python_stacks(skip=threading.get_ident())}))
        self.store.add("answered", 1)  # the reporter counts the answers with one operation, not one per rank

    def _pause(self, waited: int) -> None:
        """Sleep between two polls of a wait for other ranks: short at first, then up to 1 s (the store serves them all)."""
        time.sleep(min(1.0, self._backoff_s * 1.5 ** min(waited, 20)))

    def _answer_and_exit(self) -> None:
        try:
            self._answer()
            deadline = time.monotonic() + self.answer_s + 10.0
            polls = 0
            while not self.store.check(["report"]):
                if time.monotonic() > deadline:
                    raise DeadlineExceededError(f"no report within {self.answer_s + 10.0:g} s")
                self._pause(polls)
                polls += 1
            report = json.loads(self.store.get("report"))
            self.report, self.report_path = report["text"], Path(report["path"])
            if self.info.is_chief:
                _say(f"{report['text']}(report written to {report['path']} by rank {report['rank']})")
            else:
                _say(f"towers: the job is stuck: rank {report['rank']} wrote the report to {report['path']}; "
                     f"rank {self.info.rank} exits with code {STUCK_EXIT_CODE}.")
            self.store.add("acks", 1)
            self._wait_for_acks(int(report["answered"]))
        except Exception as exc:  # noqa: BLE001 - exit anyway: the job is being ended
            _say(f"towers: the job is stuck (another rank asked every rank to stop) and the report did not arrive: "
                 f"{exc}; rank {self.info.rank} exits with code {STUCK_EXIT_CODE}.")
        self._finish()

    def _report(self, trigger: dict[str, Any]) -> None:
        world = self.info.world_size
        self.store.set(ABORT_KEY, json.dumps({"rank": self.info.rank}))
        self._answer()
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.answer_s
        # Polled (a store.wait that times out prints C++ warnings into the user's output), on one counter:
        # the answers themselves are read once, so a large job costs the store one pass over its ranks.
        polls = 0
        while time.monotonic() < deadline:
            try:
                if self.store.add("answered", 0) >= world:
                    break
            except Exception:  # noqa: BLE001 - a store hiccup: the ranks count as silent if it lasts
                pass
            self._pause(polls)
            polls += 1
        for r in range(world):
            try:
                if self.store.check([f"answer/{r}"]):
                    answers[r] = json.loads(self.store.get(f"answer/{r}"))
            except Exception:  # noqa: BLE001
                pass
        snaps: dict[int, dict[str, Any]] = {r: a["snap"] for r, a in answers.items()}
        for r in range(world):
            if r not in snaps:
                try:
                    if self.store.check([f"beat/{r}"]):
                        snaps[r] = json.loads(self.store.get(f"beat/{r}"))
                except Exception:  # noqa: BLE001
                    pass
        text = build_report(trigger=trigger, snaps=snaps, stacks={r: a["stack"] for r, a in answers.items()},
                            world_size=world)
        path = self._write(text)
        try:
            self.store.set("report", json.dumps({"text": text, "path": str(path), "rank": self.info.rank,
                                                 "answered": len(answers) - 1}))
        except Exception:  # noqa: BLE001
            pass
        if self.info.is_chief or self.info.chief_rank not in answers:  # one copy in the job's output
            _say(f"{text}(report written to {path})")
        else:
            _say(f"towers: the job is stuck; rank {self.info.rank} wrote the report to {path} (the chief prints it); "
                 f"rank {self.info.rank} exits with code {STUCK_EXIT_CODE}.")
        self._wait_for_acks(len(answers) - 1)
        self._finish()

    def _wait_for_acks(self, expected: int) -> None:
        # Every rank that answered exits once all of them have read the report: the store may live in
        # one of them (rank 0 without an agent), and the first exit breaks the others' collectives.
        # Bounded; a rank that misses it exits anyway.
        deadline = time.monotonic() + 2.0
        polls = 0
        while time.monotonic() < deadline:
            try:
                if self.store.add("acks", 0) >= expected:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(min(0.25, 0.02 * 1.5 ** min(polls, 20)))
            polls += 1

    def _local_report(self, trigger: dict[str, Any], error: BaseException) -> None:
        r = self.info.rank
        text = build_report(trigger=trigger, snaps={r: trigger}, stacks={r: python_stacks(threading.get_ident())},
                            world_size=self.info.world_size)
        text = (f"towers: the rendezvous store at {self.info.master_addr}:{self.info.master_port} did not answer "
                f"({error}), so rank {r} could not ask the other ranks for their state; the rank hosting it "
                "(rank 0 without a launcher agent) may be stopped or gone.\n" + text)
        _say(f"{text}(report written to {self._write(text)})")
        self._finish()

    def _write(self, text: str) -> Path:
        name = f"towers-stuck-{self.info.master_port}-attempt{self.info.restart_count}-rank{self.info.rank}.txt"
        path = self.report_dir / name
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as exc:
            log.error("could not write the stuck-job report to %s: %s", path, exc)
        self.report, self.report_path = text, path
        return path

    def _finish(self, code: int = STUCK_EXIT_CODE) -> None:
        for handler in [*logging.getLogger("towers").handlers, *logging.getLogger().handlers]:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(code)
