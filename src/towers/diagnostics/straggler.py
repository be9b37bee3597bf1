"""Name the rank whose compute is consistently slower than the others' (the one every all-reduce waits for).

``StragglerDetector.observe`` takes each report's per-rank compute (forward and backward, in
seconds per step: thread CPU time on the CPU, stream time on a GPU, so waiting never counts) and
returns a finding when one rank was more than ``threshold`` above the median of the OTHER ranks
in ``k`` of the last ``m`` reports, this one included. A rank once named is named again only
after ``m`` more reports, so a job that stays uneven gets one warning per ``m`` reports.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Sequence

from towers.errors import user_error

__all__ = ["Straggler", "StragglerDetector"]


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A rank named slow: its host, the phase that is slowest relative to the others, and by how much."""

    rank: int
    host: str
    phase: str  # "forward" or "backward"
    slower: float  # 0.41: 41% above the median of the other ranks
    seconds: float  # this rank's time in ``phase`` per step
    median_seconds: float  # the other ranks' median in ``phase``

    def message(self) -> str:
        """One line for the log: who, where, which phase, by how much, and what it costs the others."""
        return (f"rank {self.rank} on {self.host}: {self.phase} {100 * self.slower:.0f}% slower than the median "
                f"({1000 * self.seconds:.1f} ms vs {1000 * self.median_seconds:.1f} ms per step); the others wait "
                "for it in the all-reduce")


class StragglerDetector:
    """Keep the last ``m`` reports' slow ranks; name one slow in ``k`` of them."""

    def __init__(self, *, threshold: float = 0.25, k: int = 3, m: int = 5, min_excess_s: float = 0.0) -> None:
        if not threshold > 0:
            raise user_error("threshold must be a positive fraction (0.25: 25% above the median)", threshold,
                             "Pass e.g. threshold=0.25.")
        if not (isinstance(k, int) and isinstance(m, int) and 1 <= k <= m):
            raise user_error("k and m must be integers with 1 <= k <= m (slow in k of the last m reports)",
                             f"k={k!r}, m={m!r}", "Pass e.g. k=3, m=5.")
        self.threshold, self.k, self.m, self.min_excess_s = float(threshold), k, m, float(min_excess_s)
        self._slow: collections.deque[set[int]] = collections.deque(maxlen=m)
        self._quiet_until: dict[int, int] = {}  # rank -> report index before which it is not named again
        self._reports = 0

    def observe(self, forward: Sequence[float], backward: Sequence[float],
                hosts: Sequence[str] | None = None) -> list[Straggler]:
        """Add one report (per-rank forward and backward seconds per step; NaN: not measured); return ranks named now."""
        self._reports += 1
        compute = [f + b for f, b in zip(forward, backward)]
        measured = [r for r, c in enumerate(compute) if c == c]  # NaN != NaN
        slow: set[int] = set()
        if len(measured) >= 2:
            for rank in measured:
                others = statistics.median(compute[r] for r in measured if r != rank)
                if compute[rank] > others * (1 + self.threshold) and compute[rank] - others > self.min_excess_s:
                    slow.add(rank)
        self._slow.append(slow)
        named = []
        for rank in sorted(slow):
            if sum(rank in s for s in self._slow) < self.k or self._reports < self._quiet_until.get(rank, 0):
                continue
            self._quiet_until[rank] = self._reports + self.m
            named.append(self._finding(rank, measured, forward, backward, hosts))
        return named

    def _finding(self, rank: int, measured: list[int], forward: Sequence[float], backward: Sequence[float],
                 hosts: Sequence[str] | None) -> Straggler:
        candidates = []
        for phase, values in (("forward", forward), ("backward", backward)):
            median = statistics.median(values[r] for r in measured if r != rank)
            candidates.append((values[rank] - median, phase, values[rank], median))
        _, phase, seconds, median = max(candidates)  # the phase that costs the others the most time
        host = hosts[rank] if hosts is not None and rank < len(hosts) else "?"
        return Straggler(rank=rank, host=host, phase=phase, slower=seconds / median - 1 if median > 0 else float("inf"),
                         seconds=seconds, median_seconds=median)
