"""Batches handed out one at a time by ps task 0, so that a dead worker's share of a dataset is not lost.

A dataset pass (one epoch of training, one ``evaluate``) is a set of *units*: the share of
global batch ``g`` that replica ``r`` would get under the static split. Worker ``w`` asks for
its next unit before each step; it gets its own units ``(g, w)`` in order first, so while every
worker lives the split (and the maths) is exactly the static one. When a worker dies, its
remaining units and every unit it held whose gradient was not applied go back into the pass,
and the survivors take them after their own.

Each batch carries its unit; ``strategy.run`` collects the units it ran, and the worker's next
push to ps task 0 names them. A unit counts as applied once that push was applied there (async)
or arrived in its sync round (the round then applies it whatever happens to the worker). A unit
fetched ahead and not yet run is not applied. An evaluation pass pushes nothing, so a dead
worker's evaluation units are all handed out again (its metric sums died with it).

A request hands out up to ``LEASE`` of the worker's own units at once (one round trip to ps
task 0 per ``LEASE`` steps); a dead worker's units go out one at a time, to spread them.

Every live worker takes the same number of steps in a pass (the Trainer's collectives pair up
by count): a worker with nothing left gets an *empty* step while another live worker still
works at that step, and the pass ends for all at the first step at which nobody got a unit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from towers._logging import get_logger
from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.transport import Status

if TYPE_CHECKING:
    from towers.strategies.parameter_server.server import ParameterServer

__all__ = ["Dispatcher", "UNIT", "EMPTY", "STOP", "LEASE", "unit_sizes"]

log = get_logger(__name__)

#: Answer kinds: a unit to compute, an empty step (keeps the step count equal), the end of the pass.
UNIT, EMPTY, STOP = "unit", "empty", "stop"
_SPEC_KEYS = ("num_examples", "global_batch_size", "drop_remainder", "start", "epoch", "num_replicas")
_MAX_CLOSED = 16
#: Passes left unfinished (e.g. ``steps_per_epoch`` stopped them) kept before the oldest is dropped.
_MAX_OPEN = 64
#: Own units handed out per request.
LEASE = 32


def unit_sizes(spec: dict[str, Any]) -> list[list[int]]:
    """Return ``sizes[g][r]``: examples in replica ``r``'s share of global batch ``g`` of the pass ``spec``."""
    n, b, w = int(spec["num_examples"]), int(spec["global_batch_size"]), int(spec["num_replicas"])
    full, rest = divmod(n, b)
    batches = [b] * full + ([rest] if rest and not spec["drop_remainder"] else [])
    return [[size // w + (1 if r < size % w else 0) for r in range(w)] for size in batches]


@dataclass
class _Pass:
    key: str
    spec: dict[str, Any]
    sizes: list[list[int]]
    own: dict[int, deque[tuple[int, int]]]  # worker -> its own units (g, w) still to hand out
    orphans: deque[tuple[int, int]] = field(default_factory=deque)  # (g, r) of dead workers
    held: dict[tuple[int, int], tuple[int, bool]] = field(default_factory=dict)  # unit -> (worker, applied)
    asked: dict[int, int] = field(default_factory=dict)  # worker -> the step it asked for last
    real: dict[int, int] = field(default_factory=dict)  # worker -> the last step it got a unit at
    closed: bool = False
    result: dict[str, int] = field(default_factory=dict)

    def expected(self) -> int:
        return sum(sum(row) for row in self.sizes[int(self.spec["start"]):])


class Dispatcher:
    """The passes in progress on ps task 0 (guarded by the server's condition variable)."""

    def __init__(self, server: "ParameterServer", lease: int = LEASE):
        self.server, self.lease = server, lease
        self.passes: dict[str, _Pass] = {}
        self.closed_order: deque[str] = deque()
        self.open_order: deque[str] = deque()
        self.dropped: set[str] = set()

    def applied(self, w: int, units: Any) -> None:
        """Record that worker ``w``'s gradients of ``units`` (``[key, g, r]`` each) were applied (lock held)."""
        for key, g, r in units if isinstance(units, list) else []:
            p = self.passes.get(str(key))
            unit = (int(g), int(r))
            if p is not None and p.held.get(unit, (None, True))[0] == w:
                p.held[unit] = (w, True)

    def next(self, w: int, meta: Any) -> dict[str, Any]:
        """Answer worker ``w``'s request for the unit of step ``meta["step"]`` of pass ``meta["key"]``."""
        if isinstance(meta, dict) and "applied" in meta:  # a model without dense parameters acknowledges apart
            with self.server.cond:
                self.applied(w, meta["applied"])
            return {}
        if not isinstance(meta, dict) or not {"key", "step", "spec"} <= set(meta):
            raise RequestError("a dispatch request needs key, step and spec.", Status.BAD_INPUT)
        key, step, spec = str(meta["key"]), int(meta["step"]), meta["spec"]
        server = self.server
        with server.cond:
            p = self.passes.get(key) or self._open(key, spec)
            if spec != p.spec:
                raise RequestError(
                    f"worker {w} iterates dataset pass {key} with {spec}, another worker with {p.spec}. Every worker "
                    "must call distribute_dataset with the same dataset size, global_batch_size, options and epoch, "
                    "in the same order.", Status.BAD_INPUT)
            p.asked[w] = step
            server.cond.notify_all()
            server._wait(lambda: p.closed or self._available(p, w) or self._everyone_at(p, step),
                         f"dataset pass {key} step {step}",
                         lambda: {u for u in server._active() if p.asked.get(u, -1) < step})
            if p.closed:
                return {"kind": STOP, **p.result}
            if self._available(p, w):
                own = p.own.get(w)
                units = [own.popleft() for _ in range(min(self.lease, len(own)))] if own else [p.orphans.popleft()]
                for g, r in units:
                    if r != w:
                        log.debug("ps task 0: worker %d takes global batch %d's share of worker %d (pass %s)", w, g,
                                 r, key)
                    p.held[(g, r)] = (w, False)
                p.real[w] = p.asked[w] = step + len(units) - 1  # as if it had asked for each of them
                return {"kind": UNIT, "units": [list(u) for u in units]}
            if any(p.real.get(u, -1) >= step for u in server._active()):
                return {"kind": EMPTY}
            self._close(p)
            return {"kind": STOP, **p.result}

    def _open(self, key: str, spec: Any) -> _Pass:
        if not isinstance(spec, dict) or set(spec) != set(_SPEC_KEYS):
            raise RequestError(f"a dispatch spec needs exactly {_SPEC_KEYS}. Received: {spec!r}.", Status.BAD_INPUT)
        if key in self.dropped:
            raise RequestError(
                f"dataset pass {key} was left unfinished and dropped after {_MAX_OPEN} newer passes started, so its "
                "batches can no longer be handed out. Iterate a distributed dataset to its end (or start a new "
                "iteration) instead of keeping many half-read iterators.", Status.BAD_INPUT)
        sizes = unit_sizes(spec)
        start, workers = int(spec["start"]), len(self.server.links)
        own = {w: deque((g, w) for g in range(start, len(sizes))) for w in range(workers)}
        p = _Pass(key, dict(spec), sizes, own)
        for w in range(workers):  # workers already gone never come for their share
            if w in self.server.dead:
                self._orphan(p, w)
        self.passes[key] = p
        self.open_order.append(key)
        open_keys = [k for k in self.open_order if k in self.passes and not self.passes[k].closed]
        self.open_order = deque(open_keys)
        while len(self.open_order) > _MAX_OPEN:  # passes abandoned part-way (steps_per_epoch, a break)
            old = self.open_order.popleft()
            self.passes.pop(old, None)
            self.dropped.add(old)
        return p

    def _available(self, p: _Pass, w: int) -> bool:
        return bool(p.own.get(w)) or bool(p.orphans)

    def _everyone_at(self, p: _Pass, step: int) -> bool:
        return all(p.asked.get(u, -1) >= step for u in self.server._active())

    def _close(self, p: _Pass) -> None:
        p.closed = True
        done = sum(p.sizes[g][r] for g, r in p.held)
        p.result = {"examples": done, "expected": p.expected()}
        self.closed_order.append(p.key)
        while len(self.closed_order) > _MAX_CLOSED:
            self.passes.pop(self.closed_order.popleft(), None)

    def _orphan(self, p: _Pass, w: int) -> int:
        """Put ``w``'s remaining and unapplied units of ``p`` back for the others; return how many."""
        units = list(p.own.pop(w, deque()))
        for unit, (holder, done) in list(p.held.items()):
            if holder == w and not done:
                del p.held[unit]
                units.append(unit)
        p.orphans.extend(sorted(units))
        p.asked.pop(w, None)
        p.real.pop(w, None)
        return len(units)

    def on_dead(self, w: int) -> None:
        """Hand ``w``'s share of every open pass to the survivors (caller holds the lock)."""
        for p in self.passes.values():
            if p.closed:
                lost = [u for u, (holder, done) in p.held.items() if holder == w and not done]
                if lost:
                    log.warning("ps task 0: worker %d died after dataset pass %s ended, holding %d unit(s) whose "
                                "results it had not handed in; that pass's results miss them", w, p.key, len(lost))
                continue
            moved = self._orphan(p, w)
            if moved:
                log.warning("ps task 0: worker %d is gone; the other workers take its %d remaining share(s) of "
                            "dataset pass %s", w, moved, p.key)

    def stats(self) -> dict[str, Any]:
        """Return each pass's state: units left, held, examples done (caller holds the lock)."""
        return {k: {"closed": p.closed, "orphans": len(p.orphans), "held": len(p.held), **p.result}
                for k, p in self.passes.items()}
