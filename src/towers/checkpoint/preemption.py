"""A preemption notice becomes one checkpoint at a step every process agrees on, then a "restart me" exit.

Kubernetes, SLURM and spot VMs send SIGTERM (SLURM: the signal ``--signal`` names) some seconds
before they take a node. ``PreemptionHandler`` catches it in any process: that process writes a
notice to the job's rendezvous store, and every process checks the store at each step boundary
(``should_save(step)``), so all of them learn of it within a step. The first to see it proposes
"after step s + 1" with an atomic compare-and-set; every process reads the one decision. In a
synchronous job no process can be past step s + 1 then (it would need the proposer's gradients
for step s + 1), so all of them save at the same step. The caller saves there and raises
``Preempted`` (exit code ``PREEMPTED_EXIT_CODE``), which ``towers launch --max-restarts``, the
manifests of ``towers k8s`` and the SLURM script treat as "restart me"; the restarted job resumes
at that step. A job loses at most the step in flight.

A second signal, or no step boundary within ``boundary_timeout_s`` of the notice (the process is
not in a training loop), restores the previous handler and delivers the signal again, so a notice
is never swallowed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Sequence

from towers._logging import get_logger

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionHandler", "preemption_signals"]

log = get_logger(__name__)

#: The exit code of a process that saved on a preemption notice: "temporary failure, start me again" (EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75

_NOTICE = "towers/preemption/notice"
_DECISION = "towers/preemption/stop_after_step"


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the process with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, step: int, path: str | None = None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.path = step, path

    def __str__(self) -> str:
        return (f"preempted: saved at step {self.step}{f' to {self.path}' if self.path else ''}; exit code "
                f"{PREEMPTED_EXIT_CODE} asks for a restart, which resumes there")


def preemption_signals(names: str | None) -> tuple[signal.Signals, ...]:
    """Return the signals named in ``names`` (``"TERM,USR1"``; default SIGTERM and SIGUSR1).

    Raises:
        ValueError: on a name that is no signal of this system.
    """
    if not names:
        return (signal.SIGTERM, signal.SIGUSR1)
    out = []
    for raw in names.replace(" ", "").split(","):
        name = raw.upper() if raw.upper().startswith("SIG") else f"SIG{raw.upper()}"
        if not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"TOWERS_PREEMPTION_SIGNALS names {raw!r}, which is not a signal that can be caught. "
                             f"Received: {names!r}. Use names such as TERM,USR1 (SLURM: the signal of --signal).")
        out.append(getattr(signal, name))
    return tuple(out)


def _default_store() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


class PreemptionHandler:
    """Catch preemption signals and agree, at a step boundary, on the step after which every process saves.

    ``install()`` (main thread only) replaces the handlers of ``signals``; ``uninstall()`` restores
    them (and re-delivers a notice nobody acted on). ``should_save(step)`` is called by every process
    at every step boundary with the number of steps done; it returns True at exactly one boundary
    per process once a notice was given anywhere in the job. ``store``: the job's key-value store
    (default: the rendezvous store of the default process group; none in a single process).
    """

    def __init__(self, *, signals: Sequence[signal.Signals] | None = None, store: Any = None,
                 boundary_timeout_s: float = 10.0, rank: int = 0):
        self.signals = tuple(signals) if signals is not None else (signal.SIGTERM, signal.SIGUSR1)
        self._store = store
        self._rank = rank
        self.boundary_timeout_s = float(boundary_timeout_s)
        self._previous: dict[signal.Signals, Any] = {}
        self.noticed: signal.Signals | None = None  # the signal this process received
        self.noticed_at_s: float | None = None
        self.decided_step: int | None = None
        self._acted = False
        self._timer: threading.Timer | None = None

    @property
    def installed(self) -> bool:
        """True while this handler owns its signals."""
        return bool(self._previous)

    def install(self) -> "PreemptionHandler":
        """Take over ``signals``; a no-op outside the main thread (signals reach only the main thread). Returns self."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return self
        if self._store is None:
            self._store = _default_store()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        log.debug("preemption handler installed for %s", [s.name for s in self.signals])
        return self

    def uninstall(self) -> None:
        """Give the signals back; a notice that no save acted on is delivered again to the previous handler."""
        self._cancel_timer()
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if self.noticed is not None and not self._acted and previous:
            log.warning("a %s notice arrived outside a training step; passing it on", self.noticed.name)
            signal.raise_signal(self.noticed)

    def _on_signal(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if self.noticed is not None:  # a second notice: stop waiting for a step boundary
            log.warning("second %s: not waiting for a step boundary", sig.name)
            self._acted = False
            self.uninstall()
            return
        self.noticed, self.noticed_at_s = sig, time.monotonic()
        log.warning("%s received: saving a checkpoint at the next step boundary that every process agrees on",
                    sig.name)
        if self._store is not None:
            try:
                self._store.set(_NOTICE, f"{self._rank}:{sig.name}")
            except Exception as exc:  # the store may be gone (the job is ending): this process still saves
                log.warning("could not tell the other processes of the notice (%s)", exc)
        self._timer = threading.Timer(self.boundary_timeout_s, self._no_boundary)
        self._timer.daemon = True
        self._timer.start()

    def _no_boundary(self) -> None:
        # Not in a training loop: the notice must not be swallowed. Exit as the signal would have.
        if self._acted or self.decided_step is not None:
            return
        sig = self.noticed or signal.SIGTERM
        log.warning("%s arrived %.0f s ago and no training step ended since: exiting without a checkpoint",
                    sig.name, self.boundary_timeout_s)
        os._exit(128 + int(sig))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def notice_given(self) -> bool:
        """Return True when a notice reached this process or (through the store) any process of the job."""
        if self.noticed is not None:
            return True
        if not self.installed:
            return False
        if self._store is None:
            self._store = _default_store()
        if self._store is None:
            return False
        try:
            return bool(self._store.check([_NOTICE]))
        except Exception:  # a store that is gone: the job is ending anyway, and the next collective says so
            return False

    def should_save(self, step: int) -> bool:
        """Return True at the step boundary (``step`` steps done) where every process saves; False elsewhere."""
        if self._acted:
            return False
        if self.decided_step is None:
            if not self.notice_given():
                return False
            self._cancel_timer()
            self.decided_step = self._decide(step)
            log.info("preemption: every process saves after step %d (this one is at %d)", self.decided_step, step)
        if step < self.decided_step:
            return False
        self._acted = True
        return True

    def _decide(self, step: int) -> int:
        if self._store is None:
            return step  # one process: save right here
        proposal = str(step + 1).encode()
        try:
            value = self._store.compare_set(_DECISION, b"", proposal)
        except Exception:  # the store is gone: save here rather than not at all
            return step
        text = value.decode() if isinstance(value, bytes) else str(value)
        return int(text) if text.strip().lstrip("-").isdigit() else step + 1
