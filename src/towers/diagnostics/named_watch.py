"""The watchdog's part of a collective every replica must call (``named.py``): publish this process's long named
call, and find out, while this process waits, whether it waits for a caller in a call it never made.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from towers.diagnostics.named import (
    ABORT_KEY,
    GRACE_S,
    LEFT_KEY,
    QUICK_S,
    TAKEN_KEY,
    WAITING_KEY,
    NamedCall,
    await_acks,
    describe,
    verdict_of,
)
from towers.diagnostics.progress import Progress, group_ranks
from towers.diagnostics.report import describe_position

__all__ = ["NamedWatch"]


def _waits_for(snap: dict[str, Any], rank: int) -> bool:
    """True when the collective this process waits in involves ``rank`` (or its group is unknown: a towers call,
    a request to parameter servers, which the job's every replica joins)."""
    fr = snap.get("collective") or {}
    if fr.get("done", True) or fr.get("pending_group") is None:
        return True
    ranks = group_ranks(fr["pending_group"])
    return ranks is None or rank in ranks


class NamedWatch:
    """The watchdog's part: publish this process's long named call; find out when it waits for one it never made."""

    def __init__(self, *, rank: int, world_size: int, store: Any, progress: Progress, poll_s: float,
                 check_s: float):
        self.rank, self.world_size, self.store, self.progress = rank, world_size, store, progress
        self.poll_s, self.check_s = poll_s, check_s
        self._published: str | None = None
        self._published_index = 0
        self._wait_since: float | None = None
        self._next_look = 0.0
        self._verdict_at: float | None = None

    def tick(self, now: float, snap: dict[str, Any], hold: Callable[[], None]) -> str | None:
        """Do this poll's part at wall time ``now``; return the error this process must end with, or None.

        ``snap`` is the process's snapshot; ``hold`` is called before a verdict is written (the watchdog keeps
        the main thread from ending the process first, once the caller raises and its connections close).
        """
        try:
            return self._tick(now, snap, hold)
        except Exception:  # noqa: BLE001 - a store hiccup: the stuck-job bound still ends a real hang
            return None

    def _tick(self, now: float, snap: dict[str, Any], hold: Callable[[], None]) -> str | None:
        call: NamedCall | None = self.progress.named
        if self._published is not None and (call is None or call.index != self._published_index):
            self.store.compare_set(WAITING_KEY, self._published, "")  # only our own record: another may be newer
            self._published, self._verdict_at = None, None
        if call is not None and self._published is None and now - call.since >= QUICK_S:
            self._published, self._published_index = json.dumps(call.record(self.rank)), call.index
            self.store.set(WAITING_KEY, self._published)
        since = snap.get("since") if snap.get("waiting") else None
        if since is None or now - float(since) < QUICK_S:
            return None
        if since != self._wait_since:  # a new wait: look at once, then less and less often
            self._wait_since, self._next_look = since, now
        if now < self._next_look:
            return None
        self._next_look = now + min(self.check_s, max(self.poll_s, (now - float(since)) / 2))
        if call is not None:
            own = verdict_of(self.store, call)
            if own is not None:
                self._verdict_at = self._verdict_at or now
                if now - self._verdict_at < GRACE_S:
                    return None  # the main thread raises it as its wait ends
                hold()
                return describe(own, self.rank, self.world_size)
            # A rank that ended before it made this call, where every replica must make it (parameter servers
            # leave a worker that said goodbye out of their gathers: no agreement in the store there).
            left = self.store.get(LEFT_KEY) if call.counter is not None and self.store.check([LEFT_KEY]) else b""
            if left and int(json.loads(left)["named_calls"]) < call.index:
                verdict = {"kind": "missing", "caller": self.rank, "operation": call.operation, "fix": call.fix,
                           "waited_s": now - call.since, "missing": json.loads(left)["rank"],
                           "where": "ended (its script finished or failed) without calling it"}
                self.store.compare_set(call.end_key, "", json.dumps(verdict))
                self.store.compare_set(ABORT_KEY, "", json.dumps({"rank": self.rank, "verdict": verdict}))
                self.store.append(f"{call.end_key}/who", f"{verdict['missing']},")
                self.store.add(f"{call.end_key}/acks", 1)  # for the rank that ended: nothing more to wait for
                self.store.add(TAKEN_KEY, 1)
                return None  # the main thread raises it as its wait ends (or GRACE_S later this watchdog ends it)
        raw = self.store.get(WAITING_KEY) if self.store.check([WAITING_KEY]) else b""
        if not raw:
            return None
        other = json.loads(raw)
        if other["rank"] == self.rank:
            return None
        if call is not None and call.index == int(other["index"]):
            if call.tag == int(other["tag"]):
                return None  # waiting together for a third rank, which looks too
            verdict = {"kind": "different", "caller": other["rank"], "operation": other["operation"],
                       "missing": self.rank, "other_operation": call.operation, "fix": other["fix"]}
            for key in (other["end_key"], call.end_key):  # both main threads wait in a named call: both raise
                self.store.compare_set(key, "", json.dumps(verdict))
            return None
        if self.progress.named_calls >= int(other["index"]):
            return None  # this rank made that call already: the record is an old one
        if not _waits_for(snap, int(other["rank"])):
            return None  # it waits in a group without the caller (a mesh's tp peer, slow): it may still come
        end_key = other["end_key"]
        if self.store.check([end_key]) and self.store.get(end_key) == b"ok":
            return None  # that call completed (another group's, on a mesh): this rank was not missing from it
        verdict = {"kind": "missing", "caller": other["rank"], "operation": other["operation"], "fix": other["fix"],
                   "waited_s": now - float(other["since"]), "missing": self.rank,
                   "where": describe_position(snap, now)}
        hold()  # from here this watchdog ends the process: the caller's raise must not reach this one first
        self.store.compare_set(end_key, "", json.dumps(verdict))
        self.store.compare_set(ABORT_KEY, "", json.dumps({"rank": self.rank, "verdict": verdict}))  # ps tasks too
        self.store.append(f"{end_key}/who", f"{self.rank},")
        self.store.add(f"{end_key}/acks", 1)
        if other.get("counter") and other.get("num_replicas"):
            await_acks(self.store, end_key, other["counter"], int(other["num_replicas"]))
        return describe(verdict, self.rank, self.world_size)
