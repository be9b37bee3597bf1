"""A preemption notice becomes one checkpoint at a step every process agrees on, then a "restart me" exit.

Kubernetes, SLURM and spot VMs send SIGTERM (SLURM: the signal ``--signal`` names) some seconds
before they take a node. ``PreemptionHandler`` catches it in any process: that process writes a
notice to the job's rendezvous store, and every process checks the store at each step boundary
(``should_save(step)``), so all of them learn of it within a step. The first to see it proposes
"after step s + 1" with an atomic compare-and-set; every process reads the one decision. In a
synchronous job no process can be past step s + 1 then (it would need the proposer's gradients
for step s + 1), so all of them save at the same step.

In a job of more than ``STEP_CHECK_BUDGET`` processes, each process reads the store only at every
``check_every_steps``-th boundary (``ceil(world_size / STEP_CHECK_BUDGET)``), so the whole job
asks the store at most ``STEP_CHECK_BUDGET`` times per step; the proposal is then the next such
boundary after s, which every process checks before it passes it (the same argument). Where the job can save
only at some boundaries (DiLoCo on the parameter servers: after an outer step, when every worker holds the
global model), the others pass ``can_save=False``: there the store is read only by a process that received a
notice itself, which proposes its next boundary; every process saves at the first boundary that can save at
or after the agreed step. No process can be past it: the outer step that ends the proposer's window needs the
proposer's push. A notice that reaches a process through the store is read at a boundary that can save, and
the save comes one window later. The caller saves there and raises
``Preempted`` (exit code ``PREEMPTED_EXIT_CODE``), which ``towers launch --max-restarts``, the
manifests of ``towers k8s`` and the SLURM script treat as "restart me"; the restarted job resumes
at that step. A job loses at most the step in flight.

A second signal, or no step boundary within ``boundary_timeout_s`` of the notice (the process is
not in a training loop), restores the previous handler and delivers the signal again, so a notice
is never swallowed.

A process that serves the training processes and runs no step of its own (a parameter-server
task: the workers' checkpoint fetches the state it holds) uses ``ServingPreemptionHandler``: a
notice it receives goes to the store like any other, and it keeps serving while the workers agree
on a step and save through it; then it exits with the restart code too. It passes the signal on
only when no process agreed on a step within ``boundary_timeout_s`` (nobody checkpoints) or a
second signal comes before they agreed; after they agreed, it exits once they are done.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Mapping, Sequence

from towers._logging import get_logger
from towers.cluster.submitit import preemption_signal_names, submitit_signal
from towers.errors import InvalidArgumentError
from towers.launch.exits import PREEMPTED_EXIT_CODE  # defined there: the ps supervisor must not import torch

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionHandler", "ServingPreemptionHandler",
           "preemption_signals", "STEP_CHECK_BUDGET", "check_every_steps"]

log = get_logger(__name__)

_NOTICE = "towers/preemption/notice"
_DECISION = "towers/preemption/stop_after_step"
_SAVING = "towers/preemption/saving_at_step"  # a process reached the agreed step: the job saves and exits


#: The most store reads of the notice that a whole job makes per training step.
STEP_CHECK_BUDGET = 1024


def check_every_steps(world_size: int) -> int:
    """Return at which step boundaries (every n-th) a process of ``world_size`` reads the store for a notice."""
    return max(1, -(-int(world_size) // STEP_CHECK_BUDGET))


def _default_world_size() -> int:
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the process with ``PREEMPTED_EXIT_CODE``.

    Args:
        step: the steps done when the checkpoint was written.
        path: the checkpoint written (None when the caller does not say).
    """

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
            raise InvalidArgumentError(f"TOWERS_PREEMPTION_SIGNALS names {raw!r}, which is not a signal that can be caught. "
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
    per process once a notice was given anywhere in the job.

    Args:
        signals: the signals that are a preemption notice. Default: SIGTERM and SIGUSR1.
        store: the job's key-value store. Default: the rendezvous store of the default process group (none in
            a single process).
        boundary_timeout_s: how long after a notice a step boundary may take; past it (or at a second signal)
            the previous handler is restored and the signal delivered again, so a notice is never swallowed.
        rank: this process's rank, written with a notice so the others can name who received it.
        every_steps: the store is read at every n-th boundary only. Default: ``check_every_steps`` of the
            default process group's size (1 up to ``STEP_CHECK_BUDGET`` processes); every process of a job must
            use the same value.
        hand_on: signals whose notice, once this process saved on it, ``uninstall`` hands to the handler it
            replaced (submitit's, which requeues the job).

    Raises:
        ValueError: an ``every_steps`` below 1.
    """

    _notice_text = "%s received: saving a checkpoint at the next step boundary that every process agrees on"

    def __init__(self, *, signals: Sequence[signal.Signals] | None = None, store: Any = None,
                 boundary_timeout_s: float = 10.0, rank: int = 0, every_steps: int | None = None,
                 hand_on: Sequence[signal.Signals] = ()):
        if every_steps is not None and int(every_steps) < 1:
            raise InvalidArgumentError(f"every_steps must be >= 1 (every process of the job the same). Received: {every_steps}.")
        self.every_steps = int(every_steps) if every_steps is not None else None
        self.signals = tuple(signals) if signals is not None else (signal.SIGTERM, signal.SIGUSR1)
        self._store = store
        self._rank = rank
        self.hand_on = tuple(hand_on)
        self.boundary_timeout_s = float(boundary_timeout_s)
        self._previous: dict[signal.Signals, Any] = {}
        self.noticed: signal.Signals | None = None  # the signal this process received
        self.noticed_at_s: float | None = None
        self.decided_step: int | None = None
        self._acted = False
        self._timer: threading.Timer | None = None

    @classmethod
    def for_job(cls, environ: Mapping[str, str], *, rank: int = 0) -> "PreemptionHandler":
        """Return a handler for the job ``environ`` describes: its signals, and submitit's handed on after the save.

        Args:
            environ: the job's environment variables (``TOWERS_PREEMPTION_SIGNALS``; submitit's variables).
            rank: this process's rank.

        Returns:
            A handler (not installed) for ``preemption_signal_names(environ)``; in a submitit job its signal is
            handed on to submitit's handler once saved.

        Raises:
            ValueError: ``TOWERS_PREEMPTION_SIGNALS`` names no signal that can be caught.
        """
        extra = submitit_signal(environ)
        return cls(signals=preemption_signals(preemption_signal_names(environ)), rank=rank,
                   hand_on=preemption_signals(extra) if extra else ())

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
        elif self.noticed in self.hand_on and callable(previous.get(self.noticed)):
            log.info("saved on %s: handing the notice to the handler it replaced (submitit requeues the job)",
                     self.noticed.name)
            previous[self.noticed](int(self.noticed), None)

    def hand_on_notice(self) -> None:
        """Once this process saved on a notice of ``hand_on``, give the signals back and hand it on (see ``uninstall``).

        Called just before ``Preempted`` is raised; a no-op for other notices, whose handler stays until
        ``uninstall`` (a second signal during the exit is still caught).
        """
        if self._acted and self.noticed in self.hand_on:
            self.uninstall()

    def _on_signal(self, signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if self.noticed is not None:  # a second notice: stop waiting for a step boundary
            log.warning("second %s: not waiting for a step boundary", sig.name)
            self._acted = False
            self.uninstall()
            return
        self.noticed, self.noticed_at_s = sig, time.monotonic()
        log.warning(self._notice_text, sig.name)
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

    def should_save(self, step: int, *, can_save: bool = True) -> bool:
        """Return True at the step boundary (``step`` steps done) where every process saves; False elsewhere.

        Args:
            step: the steps done, the same on every process at this boundary.
            can_save: False at a boundary where the job cannot take an exact checkpoint (under DiLoCo: inside a
                window, where each worker holds a model of its own). Every process saves at the first boundary
                that can, at or after the agreed step. Every process must give the same value at the same step.
        """
        if self._acted:
            return False
        if not can_save:
            if self.noticed is not None and self.decided_step is None:  # the store is read only for a notice of its own
                self._cancel_timer()  # the loop is running: the notice waits for a boundary that can save
                self.decided_step = self._decide(step)
                log.info("preemption: every process saves at the first boundary that can, from step %d on (this one "
                         "is at %d)", self.decided_step, step)
            return False
        if self.decided_step is None:
            if self.noticed is None and step % self._every() != 0:
                return False  # not a boundary where this job reads the store (nothing was noticed here)
            if not self.notice_given():
                return False
            self._cancel_timer()
            self.decided_step = self._decide(step)
            log.info("preemption: every process saves after step %d (this one is at %d)", self.decided_step, step)
        if step < self.decided_step:
            return False
        self._acted = True
        self._store_set(_SAVING, str(step))  # a serving process (a ps task) then exits for a restart too
        return True

    def _store_set(self, key: str, value: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(key, value)
        except Exception as exc:  # the store may be gone (the job is ending): this process still saves
            log.debug("could not write %s to the job's store (%s)", key, exc)

    def _store_int(self, key: str) -> int | None:
        """The integer stored at ``key`` in the job's store; None when it is absent or the store is gone."""
        if self._store is None:
            self._store = _default_store()
        if self._store is None:
            return None
        try:
            if not self._store.check([key]):
                return None
            value = self._store.get(key)
        except Exception:  # a store that is gone: the job is ending
            return None
        text = value.decode() if isinstance(value, bytes) else str(value)
        return int(text) if text.strip().lstrip("-").isdigit() else None

    def agreed_step(self) -> int | None:
        """Return the step after which the job's processes agreed to save, or None while none agreed."""
        return self._store_int(_DECISION)

    def _every(self) -> int:
        if self.every_steps is None:
            self.every_steps = check_every_steps(_default_world_size())
        return self.every_steps

    def _decide(self, step: int) -> int:
        if self._store is None:
            return step  # one process: save right here
        every = self._every()
        proposal = str((step // every + 1) * every).encode()  # the next boundary that every process checks
        try:
            value = self._store.compare_set(_DECISION, b"", proposal)
        except Exception:  # the store is gone: save here rather than not at all
            return step
        text = value.decode() if isinstance(value, bytes) else str(value)
        return int(text) if text.strip().lstrip("-").isdigit() else step + 1


class ServingPreemptionHandler(PreemptionHandler):
    """The preemption handler of a process that serves the training processes and has no step of its own (a ps task).

    A notice it receives reaches the others through the store, as on any process; then it keeps
    serving, because the workers save through it (the state they checkpoint lives there). Its
    timer passes the signal on (the process exits as the signal would have) only when no process
    agreed on a step within ``boundary_timeout_s``: nobody checkpoints, so nothing waits for it. A
    second signal after they agreed is logged and changes nothing: the process ends with them.
    ``finish()``, once every worker is done, says whether the job saved for a restart.
    """

    _notice_text = ("%s received: serving the workers while they save at the next step boundary they agree on, "
                    "then exiting for a restart")

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Once the workers agreed on a step they save through this process: a second signal (torchrun's agent
        # stopping the others after a worker exited to be restarted) must not break that save. It exits when they
        # are done.
        if self.noticed is not None and self.agreed_step() is not None:
            log.warning("%s again: the workers are saving through this process; it exits when they are done",
                        signal.Signals(signum).name)
            return
        super()._on_signal(signum, frame)

    def _no_boundary(self) -> None:
        step = self.agreed_step()
        if step is not None:
            self.decided_step = step
            log.info("preemption: the workers save after step %d; serving them until they are done", step)
            return
        super()._no_boundary()

    def finish(self) -> int | None:
        """Give the signals back; return the step the job saved at for a restart (from any process's notice), or None.

        When it returns a step the process should exit with ``PREEMPTED_EXIT_CODE``; a notice this
        process received that no save followed is delivered again (``uninstall``).
        """
        step = self._store_int(_SAVING) if self.installed else None
        if step is not None:
            self._acted, self.decided_step = True, step
        self.uninstall()
        return step
