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

A pass whose spec says ``flush`` (DiLoCo: a worker acknowledges its window's units only with its
outer push, several steps after it trained them) does not end while a live worker holds units: at
that step each holder is answered ``flush`` with its units, hands in those its push will not carry
(an evaluation's, ``computed``), pushes and asks again; a worker holding none waits for them, then
ends the pass and pushes its own window into the same round. A holder that dies meanwhile has its units
handed to the others, in the same pass: a window that was never pushed is trained again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from towers._logging import get_logger
from towers.data import shard_bounds
from towers.ledger.record import LedgerWriter, OrderSpec
from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.transport import Status

if TYPE_CHECKING:
    from towers.strategies.parameter_server.server import ParameterServer

__all__ = ["Dispatcher", "UNIT", "EMPTY", "STOP", "FLUSH", "LEASE", "pack_unit", "unpack_unit"]

log = get_logger(__name__)

#: Answer kinds: a unit to compute, an empty step (keeps the step count equal), the end of the pass.
UNIT, EMPTY, STOP = "unit", "empty", "stop"
#: Answer to a holder of units at the end of a ``flush`` pass: push them first, then ask again.
FLUSH = "flush"
_SPEC_KEYS = ("num_examples", "global_batch_size", "drop_remainder", "start", "epoch", "num_replicas")
_MAX_CLOSED = 16
#: Passes left unfinished (e.g. ``steps_per_epoch`` stopped them) kept before the oldest is dropped.
_MAX_OPEN = 64
#: Own units handed out per request.
LEASE = 32


class _Shape:
    """A pass's global batches and shares, computed on demand (a pass may have millions of batches)."""

    def __init__(self, spec: dict[str, Any]):
        n, self.b, self.replicas = int(spec["num_examples"]), int(spec["global_batch_size"]), int(spec["num_replicas"])
        self.full, rest = divmod(n, self.b)
        self.rest = 0 if spec["drop_remainder"] else rest
        self.batches = self.full + (1 if self.rest else 0)
        self.start = int(spec["start"])

    def size(self, g: int) -> int:
        return self.b if g < self.full else self.rest

    def share(self, g: int, r: int) -> int:
        """Examples in replica ``r``'s share of global batch ``g`` (the static split's, ``towers.data``)."""
        start, stop = shard_bounds(self.size(g), self.replicas, r)
        return stop - start

    def expected(self) -> int:
        """Examples in the global batches from ``start`` on."""
        return max(0, self.full - self.start) * self.b + (self.rest if self.start <= self.full else 0)


def pack_unit(units: list[Any] | None) -> tuple[int, int, int, int] | None:
    """The one dispatched batch of a push as the header's four ints (no JSON part: a push stays one small
    header and its gradients); None when there are none or several (those travel in the JSON)."""
    if not units or len(units) != 1:
        return None
    key, g, r = units[0]
    dataset, _, number = str(key)[1:].partition(".")
    if not (str(key).startswith("d") and dataset.isdigit() and number.isdigit() and int(dataset) > 0):
        return None
    return int(dataset), int(number), int(g), int(r)


def unpack_unit(ints: tuple[int, ...]) -> list[list[Any]] | None:
    """The batch ``pack_unit`` put in a push's header ints, else None."""
    return [[f"d{ints[0]}.{ints[1]}", ints[2], ints[3]]] if ints and ints[0] > 0 else None


@dataclass
class _Pass:
    key: str
    spec: dict[str, Any]
    shape: _Shape
    own: dict[int, list[int]]  # worker -> [next, end): its own global batches still to hand out
    orphans: deque[list[int]] = field(default_factory=deque)  # [g0, g1, r]: a dead worker's shares g0 .. g1-1
    held: dict[tuple[int, int], int] = field(default_factory=dict)  # unit handed out, not applied yet -> worker
    computed: set[tuple[int, int]] = field(default_factory=set)  # held units handed in without a push (evaluation)
    done: int = 0  # examples of units applied
    asked: dict[int, int] = field(default_factory=dict)  # worker -> the step it asked for last
    real: dict[int, int] = field(default_factory=dict)  # worker -> the last step it got a unit at
    closed: bool = False
    result: dict[str, int] = field(default_factory=dict)
    low: int = -1  # the lowest step every live worker had asked for at the last wake-up of the waiters
    gone: int = 0  # workers dead or finished when ``low`` was computed


class Dispatcher:
    """The passes in progress on ps task 0 (guarded by the server's condition variable)."""

    def __init__(self, server: "ParameterServer", lease: int = LEASE, *, ledger: LedgerWriter | None = None):
        self.server, self.lease = server, lease
        #: Where each applied unit is recorded (``towers.ledger``): here, where "applied" is decided.
        self.ledger = ledger
        self.passes: dict[str, _Pass] = {}
        self.closed_order: deque[str] = deque()
        self.open_order: deque[str] = deque()
        self.dropped: set[str] = set()

    def applied(self, w: int, units: Any) -> None:
        """Record that worker ``w``'s gradients of ``units`` (``[key, g, r]`` each) were applied (lock held)."""
        for key, g, r in units if isinstance(units, list) else []:
            p = self.passes.get(str(key))
            unit = (int(g), int(r))
            if p is not None and p.held.get(unit) == w:
                del p.held[unit]
                p.done += p.shape.share(*unit)
                if self.ledger is not None:
                    self._record(p, *unit)

    def _record(self, p: _Pass, g: int, r: int) -> None:
        """Append applied unit ``(g, r)`` of pass ``p`` to the ledger (a pass whose input names its order)."""
        order = p.spec.get("order")
        if not isinstance(order, dict) or self.ledger is None:
            return  # a pass from a worker that names no order
        s = p.shape
        self.ledger.order(OrderSpec(int(p.spec["num_examples"]), s.b, int(order["seed"]), bool(order["shuffle"])))
        start, stop = shard_bounds(s.size(g), s.replicas, r)
        epoch = int(p.spec["epoch"])
        self.ledger.update(epoch * s.batches + g, epoch, g, g * s.b + start, g * s.b + stop)

    def next(self, w: int, meta: Any) -> dict[str, Any]:
        """Answer worker ``w``'s request for the unit of step ``meta["step"]`` of pass ``meta["key"]``."""
        if isinstance(meta, dict) and "applied" in meta:  # a model without dense parameters acknowledges apart
            with self.server.cond:
                self.applied(w, meta["applied"])
                self.server.cond.notify_all()  # the end of a flush pass waits for held units (a push notifies itself)
            return {}
        if isinstance(meta, dict) and "computed" in meta:  # a flush's units that no push acknowledges
            with self.server.cond:
                self._computed(w, meta["computed"])
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
            self._ask(p, w, step)
            flush = bool(p.spec.get("flush"))
            # at a flush pass's end a worker without units waits for the holders to push theirs
            server.wait(lambda: p.closed or self._available(p, w) or (self._everyone_at(p, step) and (
                            not flush or bool(self._unflushed(p, w)) or not self._unflushed(p))),
                         f"dataset pass {key} step {step}",
                         lambda: {u for u in server.active() if p.asked.get(u, -1) < step})
            if p.closed:
                return {"kind": STOP, **p.result}
            if self._available(p, w):
                units = self._take(p, w)
                for unit in units:
                    p.held[unit] = w
                p.real[w] = step + len(units) - 1
                self._ask(p, w, p.real[w])  # as if it had asked for each of them
                return {"kind": UNIT, "units": [list(u) for u in units]}
            if any(p.real.get(u, -1) >= step for u in server.active()):
                return {"kind": EMPTY}
            mine = self._unflushed(p, w) if flush else []
            if mine:
                return {"kind": FLUSH, "units": [[p.key, g, r] for g, r in mine]}
            self._close(p)
            return {"kind": STOP, **p.result}

    def _ask(self, p: _Pass, w: int, step: int) -> None:
        """Record that ``w`` asked for ``step``; wake the waiting link threads when that can end a wait.

        Only when the slowest live worker moves on: waking every waiter on every request made the end of
        a pass cost O(workers^2) wake-ups (and each O(workers) to re-check), seconds at 1,000 workers.
        """
        before, p.asked[w] = p.asked.get(w, -1), step
        gone = len(self.server.dead) + len(getattr(self.server, "finished", ()))
        if before > p.low and gone == p.gone:  # w was not among the slowest, nobody left: the lowest step stays
            return
        low = min((p.asked.get(u, -1) for u in self.server.active()), default=step)
        p.gone = gone
        if low > p.low:
            p.low = low
            self.server.cond.notify_all()

    def _take(self, p: _Pass, w: int) -> list[tuple[int, int]]:
        """Up to ``lease`` of ``w``'s own units, else one orphan."""
        own = p.own.get(w)
        if own is not None and own[0] < own[1]:
            first, own[0] = own[0], min(own[1], own[0] + self.lease)
            return [(g, w) for g in range(first, own[0])]
        g0, g1, r = p.orphans[0]
        if g0 + 1 < g1:
            p.orphans[0] = [g0 + 1, g1, r]
        else:
            p.orphans.popleft()
        log.debug("ps task 0: worker %d takes global batch %d's share of worker %d (pass %s)", w, g0, r, p.key)
        return [(g0, r)]

    def _open(self, key: str, spec: Any) -> _Pass:
        if not isinstance(spec, dict) or set(spec) - {"order", "flush"} != set(_SPEC_KEYS):
            raise RequestError(f"a dispatch spec needs exactly {_SPEC_KEYS}. Received: {spec!r}.", Status.BAD_INPUT)
        if key in self.dropped:
            raise RequestError(
                f"dataset pass {key} was left unfinished and dropped after {_MAX_OPEN} newer passes started, so its "
                "batches can no longer be handed out. Iterate a distributed dataset to its end (or start a new "
                "iteration) instead of keeping many half-read iterators.", Status.BAD_INPUT)
        shape = _Shape(spec)
        if shape.replicas != len(self.server.links):
            raise RequestError(f"dataset pass {key} splits batches over {shape.replicas} replicas; this job has "
                               f"{len(self.server.links)} workers.", Status.BAD_INPUT)
        p = _Pass(key, dict(spec), shape, {w: [shape.start, shape.batches] for w in range(shape.replicas)})
        for w in range(shape.replicas):  # workers already gone never come for their share
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

    def _unflushed(self, p: _Pass, w: int | None = None) -> list[tuple[int, int]]:
        """The units of ``p`` held by ``w`` (None: by anyone) neither applied nor handed in as computed."""
        return sorted(u for u, holder in p.held.items() if (w is None or holder == w) and u not in p.computed)

    def _computed(self, w: int, units: Any) -> None:
        """``w`` hands in ``units`` it holds with no push to acknowledge them (lock held); they stay held, so a
        death before the pass ends still hands them out again (an evaluation's sums die with the worker)."""
        for key, g, r in units if isinstance(units, list) else []:
            p = self.passes.get(str(key))
            if p is not None and p.held.get((int(g), int(r))) == w:
                p.computed.add((int(g), int(r)))
        self.server.cond.notify_all()

    def _available(self, p: _Pass, w: int) -> bool:
        own = p.own.get(w)
        return (own is not None and own[0] < own[1]) or bool(p.orphans)

    def _everyone_at(self, p: _Pass, step: int) -> bool:
        return all(p.asked.get(u, -1) >= step for u in self.server.active())

    def _close(self, p: _Pass) -> None:
        p.closed = True
        # the units still held belong to live workers: computed (an evaluation pass is never "applied")
        done = p.done + sum(p.shape.share(g, r) for g, r in p.held)
        p.result = {"examples": done, "expected": p.shape.expected()}
        p.own.clear()
        self.closed_order.append(p.key)
        while len(self.closed_order) > _MAX_CLOSED:
            self.passes.pop(self.closed_order.popleft(), None)

    def _orphan(self, p: _Pass, w: int) -> int:
        """Put ``w``'s remaining and unapplied units of ``p`` back for the others; return how many."""
        held = sorted(unit for unit, holder in p.held.items() if holder == w)
        for unit in held:
            del p.held[unit]
            p.computed.discard(unit)
        p.orphans.extend([g, g + 1, r] for g, r in held)
        moved = len(held)
        own = p.own.pop(w, None)
        if own is not None and own[0] < own[1]:
            p.orphans.append([own[0], own[1], w])
            moved += own[1] - own[0]
        p.asked.pop(w, None)
        p.real.pop(w, None)
        return moved

    def on_dead(self, w: int) -> None:
        """Hand ``w``'s share of every open pass to the survivors (caller holds the lock)."""
        for p in self.passes.values():
            if p.closed:
                lost = [u for u, holder in p.held.items() if holder == w]
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
        return {k: {"closed": p.closed, "orphans": sum(g1 - g0 for g0, g1, _ in p.orphans), "held": len(p.held),
                    **p.result} for k, p in self.passes.items()}
