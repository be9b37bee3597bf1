"""Each rank's step time by phase, gathered on the chief every N steps, with the straggler named.

``StepBreakdown`` is the custom loop's switch (off unless made); the Trainer's is
``towers.callbacks.StepBreakdown`` (on by default). Both report through ``BreakdownReporter``: at
a report step, which every rank reaches at the same step, one ``strategy.reduce`` of a small
table (rank x phase) gives every rank every rank's seconds per step; the chief logs one summary
line and a warning for a straggler.

    breakdown = towers.diagnostics.StepBreakdown(model, optimizer, strategy, every=50)
    for x, y in breakdown.timed(batches):      # the time next() takes is the input phase
        loss = compute_average_loss(loss_fn(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()                          # a step ends at each optimizer update
        optimizer.zero_grad()
    breakdown.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import socket
import statistics
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from towers._logging import get_logger
from towers.diagnostics.breakdown import PHASES, StepTimer, measured_step, timed_batches
from towers.diagnostics.straggler import Straggler, StragglerDetector
from towers.errors import user_error
from towers.strategies.base import PeerLostError, Strategy

__all__ = ["BreakdownReport", "BreakdownReporter", "StepBreakdown", "check_every", "communicates"]

log = get_logger(__name__)


def check_every(every: Any, name: str = "every") -> int:
    """Return ``every`` when it is an integer >= 1.

    Raises:
        ValueError: otherwise.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise user_error(f"{name} must be a positive integer (a report every that many steps)", every,
                         f"Pass e.g. {name}=50.")
    return every


def communicates(strategy: Strategy) -> bool:
    """True when ``strategy``'s steps wait for peers (other replicas, parameter servers, pipeline stages): its
    threads' sleeps are ``comm_wait``. One process alone has only the machine to wait for."""
    return strategy.num_replicas_in_sync > 1 or strategy.process_info.world_size > 1


@dataclasses.dataclass(frozen=True)
class BreakdownReport:
    """Every rank's seconds per step in each phase (``PHASES``) over the steps measured before ``global_step``."""

    global_step: int
    steps: list[int]  # steps measured, per rank
    seconds: list[list[float]]  # [rank][phase], seconds per step; NaN where a rank measured no step
    hosts: list[str]
    stragglers: list[Straggler]
    #: The job has peers to wait for; False: there is no ``comm_wait`` (not logged, not in the summary).
    communicates: bool = True

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases this report tells: ``PHASES``, less ``comm_wait`` in a job without communication."""
        return PHASES if self.communicates else tuple(p for p in PHASES if p != "comm_wait")

    def _column(self, phase: str) -> list[tuple[float, int]]:
        i = PHASES.index(phase)
        return [(row[i], rank) for rank, row in enumerate(self.seconds) if self.steps[rank] > 0]

    def median(self, phase: str) -> float:
        """The median over the ranks of ``phase``'s seconds per step (NaN when no rank measured a step)."""
        column = self._column(phase)
        return statistics.median(v for v, _ in column) if column else math.nan

    def slowest(self, phase: str) -> tuple[float, int]:
        """``(seconds per step, rank)`` of the rank that spent the most time in ``phase``."""
        return max(self._column(phase), default=(math.nan, -1))

    def logs(self) -> dict[str, float]:
        """``time/<phase>`` (median over ranks) and ``time/<phase>_max`` (slowest rank), seconds per step."""
        if not any(self.steps):
            return {}
        out: dict[str, float] = {}
        for phase in self.phases:
            out[f"time/{phase}"] = self.median(phase)
            out[f"time/{phase}_max"] = self.slowest(phase)[0]
        return out

    def summary(self) -> str:
        """One line: per phase, the median over ranks and the slowest rank, in ms per step."""
        parts = []
        for phase in self.phases:
            worst, rank = self.slowest(phase)
            parts.append(f"{phase} {1000 * self.median(phase):.1f}/{1000 * worst:.1f} (r{rank})")
        measured = min((s for s in self.steps if s), default=0)
        return (f"step breakdown at step {self.global_step}, ms per step over the last {measured} step(s), "
                f"median/max rank of {len(self.steps)}: " + ", ".join(parts))


class BreakdownReporter:
    """Gathers a ``StepTimer``'s sums from every rank at a report step; the chief logs the summary and stragglers."""

    def __init__(self, strategy: Strategy, *, threshold: float = 0.25, k: int = 3, m: int = 5) -> None:
        self.strategy = strategy
        self.detector = StragglerDetector(threshold=threshold, k=k, m=m)
        self._hosts: list[str] | None = None
        self.last: BreakdownReport | None = None

    def report(self, timer: StepTimer, global_step: int) -> BreakdownReport | None:
        """Gather this rank's measured steps with every other rank's (a collective: call it on every rank).

        Returns None when a peer was lost meanwhile (fault-tolerant strategies): the sums are dropped.
        """
        steps, sums = timer.take()
        strategy = self.strategy
        n = strategy.num_replicas_in_sync
        table = torch.zeros(n, 1 + len(PHASES), dtype=torch.float64)
        table[strategy.replica_id, 0] = float(steps)
        table[strategy.replica_id, 1:] = torch.tensor(sums, dtype=torch.float64)
        try:
            if self._hosts is None or len(self._hosts) != n:
                self._hosts = [str(h) for h in strategy.all_gather_object(socket.gethostname())]
            table = strategy.reduce("sum", table.to(strategy.device)).to("cpu")
        except PeerLostError as exc:
            log.info("step breakdown skipped at step %d: %s", global_step, str(exc).splitlines()[0])
            return None
        counts = [int(c) for c in table[:, 0].tolist()]
        seconds = [[v / c if c else math.nan for v in row] for row, c in zip(table[:, 1:].tolist(), counts)]
        forward, backward = PHASES.index("forward"), PHASES.index("backward")
        found = self.detector.observe([r[forward] for r in seconds], [r[backward] for r in seconds], self._hosts)
        report = BreakdownReport(global_step=global_step, steps=counts, seconds=seconds, hosts=list(self._hosts),
                                 stragglers=found, communicates=communicates(strategy))
        self.last = report
        if strategy.is_chief and any(counts):
            log.info("%s", report.summary())
            for straggler in found:
                log.warning("straggler: %s", straggler.message())
        return report


class StepBreakdown:
    """Time each phase of a custom loop's steps and report every ``every`` optimizer updates (off unless made).

    Hooks ``model``'s forward and ``optimizer``'s step; a step ends at each update. Mark the wait for
    batches with ``timed(batches)``, ``with breakdown.input():`` or ``input_begin()``/``input_end()``
    (unmarked, it is part of ``other``). Every rank must make one and update the same number of
    times: a report is a collective. ``last_report`` holds the latest ``BreakdownReport``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, *, every: int = 50,
                 threshold: float = 0.25, k: int = 3, m: int = 5) -> None:
        self.every = check_every(every)
        self.updates = 0
        self._reporter = BreakdownReporter(strategy, threshold=threshold, k=k, m=m)
        self.timer = StepTimer(strategy.device, on_update=self._after_update, communicates=communicates(strategy))
        self.timer.attach(model, optimizer)
        self.timer.arm(measured_step(1, self.every))

    @property
    def last_report(self) -> BreakdownReport | None:
        """The latest report (None before the first)."""
        return self._reporter.last

    def _after_update(self) -> None:
        self.updates += 1
        if self.updates % self.every == 0:
            self._reporter.report(self.timer, self.updates)
        self.timer.arm(measured_step(self.updates + 1, self.every))

    def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield ``batches``, timing each fetch as the input phase."""
        return timed_batches(batches, self.timer)

    @contextlib.contextmanager
    def input(self) -> Iterator[None]:
        """Time the block as the input phase (e.g. around ``next(iterator)``)."""
        self.timer.input_begin()
        try:
            yield
        finally:
            self.timer.input_end()

    def input_begin(self) -> None:
        """The loop starts waiting for its next batch."""
        self.timer.input_begin()

    def input_end(self) -> None:
        """The batch arrived."""
        self.timer.input_end()

    def close(self) -> None:
        """Remove the hooks (no more reports)."""
        self.timer.detach()
        self.timer.arm(False)

    def __enter__(self) -> "StepBreakdown":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
