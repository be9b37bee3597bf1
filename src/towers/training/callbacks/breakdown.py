"""``StepBreakdown``: the Trainer's per-rank step breakdown (on by default), with the straggler named.

Every ``every`` global steps, each rank's seconds per step in input, forward, backward,
comm_wait (jobs that communicate), cpu_wait, optimizer and other (measured over the steps just
before, without adding a synchronisation to them: see ``towers.diagnostics.breakdown``) are
gathered in one collective; the chief logs the breakdown on a line of its own (median and slowest
rank per phase) and a warning naming a rank whose compute is consistently slower than the others'.
The logs of that step get ``time/<phase>`` (median over ranks) and ``time/<phase>_max`` (slowest
rank), and so do the logs of the epoch it was measured in (the History, the trackers); an epoch
without a report has none (the progress line never shows them: they are the breakdown's line).

Input is the time between the end of one step's ``on_train_batch_end`` (all callbacks) and the
next ``on_train_batch_begin``: the callback is called first (so the loggers after it see its
keys) and its ``marker`` last (so the other callbacks' time is ``other``, not input).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from towers.diagnostics.breakdown import StepTimer, measured_step
from towers.diagnostics.step_breakdown import BreakdownReport, BreakdownReporter, check_every, communicates
from towers.errors import user_error
from towers.training.callbacks.base import Callback, CallbackList

__all__ = ["StepBreakdown", "DEFAULT_BREAKDOWN_EVERY", "with_step_breakdown"]

#: The Trainer's default period, in steps: its cost (hooks on every step, 10 measured steps and one
#: small collective per period) stays under 1% of the seed CNN's step (BENCHMARKS.md).
DEFAULT_BREAKDOWN_EVERY = 100


class StepBreakdown(Callback):
    """Report each rank's step time by phase every ``every`` global steps and name a straggler.

    Args:
        every: report every that many global steps.
        threshold: how much slower than the other ranks' median (as a fraction: 0.25 = 25 %) a rank's
            forward+backward compute must be to count as slow in a report.
        k: the reports, among the last ``m``, in which a rank must be slow to be named.
        m: the reports looked back on.
    """

    def __init__(self, every: int = DEFAULT_BREAKDOWN_EVERY, *, threshold: float = 0.25, k: int = 3,
                 m: int = 5) -> None:
        super().__init__()
        self.every = check_every(every)
        self._options: dict[str, Any] = {"threshold": threshold, "k": k, "m": m}
        self._reporter: BreakdownReporter | None = None
        self._timer: StepTimer | None = None
        self._epoch_logs: dict[str, float] = {}
        #: Called last among the Trainer's callbacks: the step ends and the wait for the next batch begins.
        self.marker = _StepEnd(self)

    @property
    def last_report(self) -> BreakdownReport | None:
        """The latest report (None before the first)."""
        return self._reporter.last if self._reporter is not None else None

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        trainer = self.trainer
        strategy = trainer.strategy
        if self._reporter is None or self._reporter.strategy is not strategy:
            self._reporter = BreakdownReporter(strategy, **self._options)
        self._timer = StepTimer(strategy.device, communicates=communicates(strategy))
        self._timer.attach(trainer.model, trainer.optimizer)
        self._epoch_logs = {}
        self._timer.arm(measured_step(trainer.progress.global_step + 1, self.every))

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch_logs = {}  # an epoch's logs carry the breakdown measured in it, not an earlier epoch's

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._timer is not None:
            self._timer.input_end()

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._timer is None or self._reporter is None or logs is None:
            return
        step = int(logs.get("global_step", 0))
        if step % self.every:
            return
        report = self._reporter.report(self._timer, step)  # every rank: the same global step
        if report is not None and isinstance(logs, dict):
            self._epoch_logs = report.logs()
            logs.update(self._epoch_logs)

    def step_ended(self, logs: Mapping[str, Any] | None) -> None:
        """The step ended (called by ``marker``, after every other callback): count it; time the next input."""
        if self._timer is None:
            return
        self._timer.end_step()
        self._timer.arm(measured_step(int((logs or {}).get("global_step", 0)) + 1, self.every))
        self._timer.input_begin()

    def on_test_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._timer is not None:
            self._timer.discard()  # validation is no step's input

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._timer is not None:
            self._timer.discard()
        if isinstance(logs, dict):
            logs.update(self._epoch_logs)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._timer is not None:
            self._timer.detach()
            self._timer = None


class _StepEnd(Callback):
    """The last of the Trainer's callbacks: ends its ``StepBreakdown``'s step and starts timing the input."""

    def __init__(self, owner: StepBreakdown) -> None:
        super().__init__()
        self._owner = owner

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._owner.step_ended(logs)


class _WithBreakdown(CallbackList):
    """``callbacks`` as fit keeps them (iteration, hence the checkpointed callback states, unchanged), with
    ``breakdown`` called first and its marker last at every hook."""

    def __init__(self, callbacks: CallbackList, breakdown: StepBreakdown) -> None:
        super().__init__()
        self._kept = list(callbacks)
        self.callbacks = [breakdown, *(cb for cb in self._kept if cb is not breakdown), breakdown.marker]

    def __iter__(self) -> Iterator[Callback]:
        return iter(self._kept)


def with_step_breakdown(callbacks: CallbackList, every: int | None) -> CallbackList:
    """Return ``callbacks`` calling a ``StepBreakdown`` first and its marker last (their trainer attached).

    The user's own ``StepBreakdown`` among ``callbacks`` is used; else one every ``every`` steps (None:
    ``DEFAULT_BREAKDOWN_EVERY``); ``every=0`` and none given: ``callbacks`` itself. Iterating the result
    gives ``callbacks``' own, in their order: the keys of their checkpointed states do not move.

    Raises:
        ValueError: two ``StepBreakdown`` callbacks.
    """
    own = [cb for cb in callbacks if isinstance(cb, StepBreakdown)]
    if len(own) > 1:
        raise user_error("fit takes at most one StepBreakdown callback", f"{len(own)} of them",
                         "Pass one (its every= sets the period).")
    if own:
        breakdown = own[0]
    elif every == 0:
        return callbacks
    else:
        breakdown = StepBreakdown(DEFAULT_BREAKDOWN_EVERY if every is None else every)
    trainer = next((cb.trainer for cb in callbacks if cb.attached), None)
    if trainer is not None:
        breakdown.set_trainer(trainer)
        breakdown.marker.set_trainer(trainer)
    return _WithBreakdown(callbacks, breakdown)
