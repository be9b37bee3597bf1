"""Collectives every replica must call (``Metric.result()``): when one replica did not, every rank says so within
seconds, naming the call and its fix, instead of waiting out a timeout.

``named_call(operation, fix)`` marks such a call on this process (``PROGRESS.named``); its index counts them, so
on every replica of a correct program the k-th one is the same call.

**Agreement** (the synchronous strategies, ``StoreAgreement``): before the collective itself, each replica adds one
to a counter in the job's store (``named/<group>/<index>/<tag>``, the tag being the operation's); the last to
arrive writes ``ok`` to the call's end key, on which the others wait. Two or three store round trips per replica
and call, and nothing that could pair with another rank's gradient all-reduce.

**Rescue** (every strategy, by the watchdogs, ``named_watch.NamedWatch``): a rank that has waited ``QUICK_S``
in a named call publishes it (``named/waiting``: rank, index, operation, fix, end key). A rank that has waited
``QUICK_S`` in anything else reads that key at 2, 3, 4.5, ... s of its wait (then every ``check_s``); reading
costs nothing before. When it never entered that call (its count is lower), it cannot come: it waits, in another collective,
for the caller. It then writes the verdict to the call's end key, and to the watchdogs' ``abort`` key (so that
every other process, a parameter-server task or a rank that computes, ends with it within its ``check_s``).
The caller wakes on the end key. It and the missing replicas wait (``ACK_S`` at most) until every missing
replica took the verdict; then the caller raises ``PartialCollectiveError`` and the others end (exit 1) with
it. Where the caller waits elsewhere (on a parameter server) it reads the verdict when that wait ends, and its
watchdog ends it ``GRACE_S`` after the verdict if it does not. Two ranks in different named calls at the same
index get the verdict on both end keys. A process that ends says so at interpreter exit (``publish_exit``): a
caller waiting in a call that process never made then ends with the verdict too.
"""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

from towers.diagnostics.progress import PROGRESS, Progress

__all__ = ["QUICK_S", "GRACE_S", "ACK_S", "ABORT_KEY", "WAITING_KEY", "TAKEN_KEY", "LEFT_KEY", "NamedCall", "named_call",
           "describe", "verdict_of", "StoreAgreement", "await_acks", "take_verdict", "publish_exit"]

#: How long a rank waits in a named call before the others are asked where they are (and they look).
QUICK_S = 2.0
#: How long a caller's main thread has to raise a verdict before its watchdog ends the process with it.
GRACE_S = 3.0
#: How long a caller waits for every replica missing from its call to take the verdict before it raises (its exit
#: breaks their collectives: one that had not looked yet would end with a bare "Connection closed" instead).
ACK_S = 5.0
#: The watchdogs' key that ends the job (``watchdog.py``); a verdict there ends every process with the error.
ABORT_KEY = "abort"
#: Where a rank that has waited QUICK_S in a named call publishes it (``named_watch.py`` reads it).
WAITING_KEY = "named/waiting"
#: How many processes took the job's verdict (``take_verdict``).
TAKEN_KEY = "named/verdict_taken"
#: The last process that ended, and after how many named calls (``publish_exit``).
LEFT_KEY = "named/left"


@dataclass
class NamedCall:
    """One call of a collective every replica must make, on this process."""

    index: int
    operation: str
    fix: str
    #: Wall time the call began.
    since: float
    #: Where its verdict goes: the agreement's key when the strategy agrees in the store, else one per index.
    end_key: str
    #: The agreement's arrival counter and replica count (None where the strategy does not agree in the store).
    counter: str | None = None
    num_replicas: int | None = None

    @property
    def tag(self) -> int:
        """The operation as a number: calls at the same index with different tags are different collectives."""
        return zlib.crc32(self.operation.encode("utf-8"))

    def record(self, rank: int) -> dict[str, Any]:
        """Return what the watchdog publishes about this call (JSON-ready)."""
        return {"rank": rank, "index": self.index, "operation": self.operation, "fix": self.fix, "tag": self.tag,
                "since": self.since, "end_key": self.end_key, "counter": self.counter,
                "num_replicas": self.num_replicas}


@contextlib.contextmanager
def named_call(operation: str, fix: str, progress: Progress = PROGRESS) -> Iterator[NamedCall]:
    """Mark the block as this process's next collective that every replica must call; yield its ``NamedCall``."""
    progress.named_calls += 1
    call = NamedCall(progress.named_calls, operation, fix, time.time(), f"named/-/{progress.named_calls}/end")
    progress.named = call
    try:
        yield call
    finally:
        progress.named = None


def describe(verdict: dict[str, Any], rank: int, world_size: int) -> str:
    """Return the error text of ``verdict`` (what the rescue wrote) as rank ``rank`` of ``world_size`` says it."""
    me = f"[rank {rank}/{world_size}]"
    if verdict.get("kind") == "different":
        return (f"{me} rank {verdict['caller']} called {verdict['operation']} while rank {verdict['missing']} called "
                f"{verdict['other_operation']} at the same point of the loop: these are collectives, so every replica "
                f"must call the same ones in the same order. {verdict['fix']}")
    missing = int(verdict["missing"])
    ranks = [int(r) for r in verdict.get("missing_ranks") or [missing]]  # every one the caller heard from
    if missing == rank or len(ranks) == 1:
        who = f"rank {missing}" + (" (this rank)" if missing == rank else "")
        went = f"which went on and {verdict['where']}"
    else:
        who = f"ranks {', '.join(map(str, ranks))}"
        went = f"which went on (rank {missing} {verdict['where']})"
    return (f"{me} {verdict['operation']} was called on rank {verdict['caller']} (which waited "
            f"{float(verdict['waited_s']):.1f} s for the others) but not on {who}, {went}. It is a collective: every "
            f"replica must call it, at the same point of the loop. {verdict['fix']}")


def verdict_of(store: Any, call: NamedCall) -> dict[str, Any] | None:
    """Return the verdict written to ``call``'s end key, or None (none, ``ok``, or the store is gone).

    Reads the store only for a call that lasted ``QUICK_S``: no rescue can have come sooner.
    """
    if store is None or time.time() - call.since < QUICK_S:
        return None
    try:
        value = store.get(call.end_key) if store.check([call.end_key]) else b""
    except Exception:  # noqa: BLE001 - a store that went away (its host ended) has no verdict to give
        return None
    return None if value in (b"", b"ok") else json.loads(value)


class StoreAgreement:
    """Every replica of one group enters a named call before its collective runs, checked in the job's store."""

    def __init__(self, store: Any, group: str):
        self.store, self.group = store, group
        self._previous: list[str] = []  # the last agreed call's keys, deleted by whoever completes the next one

    def agree(self, call: NamedCall, num_replicas: int, timeout_s: float | None) -> dict[str, Any] | None:
        """Return None once all ``num_replicas`` replicas entered ``call``, or the verdict that one never will.

        Raises:
            RuntimeError: torch's ``DistStoreError`` when ``timeout_s`` passed first, or the store failed.
        """
        base = f"named/{self.group}/{call.index}"
        call.end_key, call.counter, call.num_replicas = f"{base}/end", f"{base}/{call.tag}", num_replicas
        counter = call.counter
        if self.store.add(counter, 1) >= num_replicas:
            value = self.store.compare_set(call.end_key, "", "ok")  # a verdict written first stays
            for key in self._previous:  # every replica has read them: all of them are here
                self.store.delete_key(key)
        else:
            if timeout_s is None:
                self.store.wait([call.end_key])
            else:
                self.store.wait([call.end_key], timedelta(seconds=timeout_s))
            value = self.store.get(call.end_key)
        self._previous = [counter, call.end_key]
        if value == b"ok":
            return None
        verdict: dict[str, Any] = json.loads(value)
        if verdict.get("kind") == "missing":
            await_acks(self.store, call.end_key, counter, num_replicas)
            who = self.store.get(f"{call.end_key}/who") if self.store.check([f"{call.end_key}/who"]) else b""
            verdict["missing_ranks"] = sorted({int(r) for r in who.decode().split(",") if r})
        return verdict


def await_acks(store: Any, end_key: str, counter: str, num_replicas: int) -> None:
    """Return once every replica missing from the call took its verdict (``ACK_S`` at most: one that computes never
    does). Until then none of them ends: the first exit breaks the others' collectives, and a launcher stops them."""
    _await_count(store, f"{end_key}/acks", num_replicas - store.add(counter, 0))


def _await_count(store: Any, key: str, target: int) -> None:
    deadline, pause = time.monotonic() + ACK_S, 0.01
    while store.add(key, 0) < target and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(0.25, pause * 1.5)


def publish_exit(store: Any, rank: int, progress: Progress = PROGRESS) -> None:
    """Say in the store that this process ends (at interpreter exit) after ``progress.named_calls`` named calls.

    A caller that waits in a later one then knows that this rank will never come: a script that ended, or
    failed, before the call (``result()`` on the chief alone after the training loop). A ps task says nothing.
    """
    if progress.role == "ps":
        return
    try:
        store.set(LEFT_KEY, json.dumps({"rank": rank, "named_calls": progress.named_calls}))
    except Exception:  # noqa: BLE001 - the process ends either way
        pass


def take_verdict(store: Any, *, hosts_store: bool, world_size: int) -> None:
    """Count this process among those that took the job's verdict (once per process: the caller sees to it).

    The process that hosts the store (rank 0 without a launcher's agent) then waits, ``ACK_S`` at most, until
    every process took it: its exit ends the store, and a process that had not read the verdict yet (a
    parameter-server task looks every ``PS_CHECK_S``) would end with a bare connection error instead.
    """
    try:
        store.add(TAKEN_KEY, 1)
        if hosts_store:
            _await_count(store, TAKEN_KEY, world_size)
    except Exception:  # noqa: BLE001 - the job ends either way
        pass
