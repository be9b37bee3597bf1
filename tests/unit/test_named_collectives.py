"""A collective every replica must call (``Metric.result()``) without processes: the store agreement, and the watchdogs'
rescue that finds a replica waiting elsewhere, driven tick by tick on an in-memory store."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch.distributed as dist

from towers.cluster.info import ProcessInfo
from towers.diagnostics.named import QUICK_S, StoreAgreement, describe, named_call, publish_exit, verdict_of
from towers.diagnostics.named_watch import NamedWatch
from towers.diagnostics.progress import Progress
from towers.diagnostics.watchdog import Watchdog

OP, FIX = "Metric.result() of 'accuracy'", "Call result() on every replica and print on the chief."


def _watch(rank: int, store: Any, progress: Progress, world_size: int = 2) -> NamedWatch:
    return NamedWatch(rank=rank, world_size=world_size, store=store, progress=progress, poll_s=0.1, check_s=10.0)


def _waiting(since: float, where: str = "all_reduce") -> dict:
    """A snapshot of a rank that waits, since ``since``, in collective #58 (``where``)."""
    fr = {"seq": 57, "kind": where, "done": False, "since": since, "pending_seq": 58, "pending_kind": where}
    return {"waiting": True, "since": since, "collective": fr, "call": None, "calls": 3}


class _Store:
    """torch's in-memory store, telling who waits for them which keys were added to (its own ``wait`` does not)."""

    def __init__(self) -> None:
        self.store, self.added, self.changed = dist.HashStore(), set(), threading.Condition()

    def add(self, key: str, amount: int) -> int:
        value = self.store.add(key, amount)
        with self.changed:
            self.added.add(key)
            self.changed.notify_all()
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _agree_in_thread(agreement: StoreAgreement, call: Any, replicas: int, out: dict, key: str) -> threading.Thread:
    """Start ``agreement.agree(call, ...)`` in a thread; return once it arrived (its count is in the store)."""
    def run() -> None:
        out[key] = agreement.agree(call, replicas, timeout_s=30)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    store = agreement.store
    with store.changed:
        assert store.changed.wait_for(lambda: f"named/g/{call.index}/{call.tag}" in store.added, timeout=30)
    return thread


def test_every_replica_in_the_call_agrees_and_the_last_cleans_the_call_before() -> None:
    store, out = _Store(), {}
    progress = [Progress(), Progress()]
    for _ in range(2):  # two calls in a row, both agreed
        with named_call(OP, FIX, progress[0]) as first, named_call(OP, FIX, progress[1]) as second:
            waiter = _agree_in_thread(StoreAgreement(store, "g"), first, 2, out, "first")
            out["second"] = StoreAgreement(store, "g").agree(second, 2, timeout_s=30)
            waiter.join(30)
        assert out == {"first": None, "second": None}
    assert progress[0].named_calls == progress[1].named_calls == 2 and progress[0].named is None


def test_a_replica_waiting_elsewhere_takes_the_verdict_and_the_caller_raises_it() -> None:
    """Rank 0 calls result(); rank 1 went on to its next gradient all-reduce and waits there."""
    store, out = _Store(), {}
    caller, other = Progress(), Progress()
    with named_call(OP, FIX, caller) as call:
        waiter = _agree_in_thread(StoreAgreement(store, "g"), call, 2, out, "verdict")
        now = call.since + QUICK_S + 0.5
        assert _watch(0, store, caller).tick(now, _waiting(call.since), hold=lambda: None) is None  # publishes
        held: list[bool] = []
        error = _watch(1, store, other).tick(now, _waiting(call.since + 0.1), hold=lambda: held.append(True))
        waiter.join(30)
    assert held == [True]  # this rank's main thread was held before the caller could raise
    assert error is not None and error.startswith(f"[rank 1/2] {OP} was called on rank 0 (which waited 2.5 s")
    assert "but not on rank 1 (this rank), which went on and waits 2.4 s in collective #58 (all_reduce)" in error
    assert error.endswith(FIX)
    verdict = out["verdict"]
    assert verdict["missing_ranks"] == [1]
    told = describe(verdict, 0, 2)
    assert told.startswith(f"[rank 0/2] {OP} was called on rank 0") and "but not on rank 1, which went on" in told
    assert json.loads(store.get("abort"))["verdict"]["operation"] == OP  # every other process ends with it too


def test_a_caller_waiting_for_a_rank_whose_script_ended_gets_the_verdict() -> None:
    """The chief calls result() alone after the loop; rank 1's script ended (after no named call)."""
    store, out = _Store(), {}
    caller, ended = Progress(), Progress()
    publish_exit(store, 1, ended)
    with named_call(OP, FIX, caller) as call:
        waiter = _agree_in_thread(StoreAgreement(store, "g"), call, 2, out, "verdict")
        _watch(0, store, caller).tick(call.since + QUICK_S + 0.5, _waiting(call.since), hold=lambda: None)
        waiter.join(30)
    told = describe(out["verdict"], 0, 2)
    assert told.startswith(f"[rank 0/2] {OP} was called on rank 0 (which waited 2.5 s for the others) but not on "
                           "rank 1, which went on and ended (its script finished or failed) without calling it."), told


def test_a_record_of_a_call_this_rank_already_made_is_no_verdict() -> None:
    store = _Store()
    caller, other = Progress(), Progress()
    with named_call(OP, FIX, other):
        pass  # rank 1 made call #1 already
    with named_call(OP, FIX, caller) as call:  # rank 0 is (still) in call #1 and published it
        now = call.since + QUICK_S + 0.5
        _watch(0, store, caller).tick(now, _waiting(call.since), hold=lambda: None)
        assert _watch(1, store, other).tick(now, _waiting(call.since), hold=lambda: None) is None
    assert not store.check([call.end_key]) and not store.check(["abort"])


def test_two_ranks_in_different_calls_at_the_same_point_both_get_the_verdict() -> None:
    store, out = _Store(), {}
    first, second = Progress(), Progress()
    with named_call(OP, FIX, first) as a, named_call("Metric.result() of 'loss'", FIX, second) as b:
        threads = [_agree_in_thread(StoreAgreement(store, "g"), a, 2, out, "a"),
                   _agree_in_thread(StoreAgreement(store, "g"), b, 2, out, "b")]
        watches = [_watch(0, store, first), _watch(1, store, second)]
        now = a.since + QUICK_S + 0.5
        watches[0].tick(now, _waiting(a.since), hold=lambda: None)  # publishes rank 0's call
        watches[1].tick(now, _waiting(b.since), hold=lambda: None)  # publishes rank 1's: the newer record
        watches[0].tick(now + 5, _waiting(a.since), hold=lambda: None)  # rank 0 looks again: another call at #1
        for thread in threads:
            thread.join(30)
    assert out["a"] == out["b"] and out["a"]["kind"] == "different"
    assert "rank 1 called Metric.result() of 'loss' while rank 0 called Metric.result() of 'accuracy'" in describe(out["a"], 0, 2)


def test_a_rank_waiting_in_a_group_without_the_caller_may_still_come(monkeypatch) -> None:
    """On a mesh, rank 2 waits for its slow tp peer 3, in a group without the caller (rank 0): no verdict yet."""
    import towers.diagnostics.named_watch as named_watch

    monkeypatch.setattr(named_watch, "group_ranks", {"tp": [2, 3], "dp": [0, 2]}.get)
    store, caller = _Store(), Progress()
    with named_call(OP, FIX, caller) as call:
        now = call.since + QUICK_S + 0.5
        _watch(0, store, caller, world_size=4).tick(now, _waiting(call.since), hold=lambda: None)
        in_tp = {**_waiting(call.since), "collective": {**_waiting(call.since)["collective"], "pending_group": "tp"}}
        assert _watch(2, store, Progress(), world_size=4).tick(now, in_tp, hold=lambda: None) is None
        in_dp = {**in_tp, "collective": {**in_tp["collective"], "pending_group": "dp"}}
        assert "but not on rank 2 (this rank)" in str(_watch(2, store, Progress(), 4).tick(now, in_dp, lambda: None))


class _CountingStore:
    """A store that counts the operations made on it."""

    def __init__(self) -> None:
        self.store, self.operations = dist.HashStore(), 0

    def __getattr__(self, name: str) -> Any:
        self.operations += 1
        return getattr(self.store, name)


def test_nothing_reaches_the_store_before_a_wait_lasted_quick_s() -> None:
    store, progress = _CountingStore(), Progress()
    watch = _watch(1, store, progress)
    with named_call(OP, FIX, progress) as call:
        now = call.since + QUICK_S / 2
        assert watch.tick(now, _waiting(call.since), hold=lambda: None) is None
        assert verdict_of(store, call) is None  # a call shorter than QUICK_S had no rescue to read
    assert watch.tick(time.time(), _waiting(time.time() - QUICK_S / 2), hold=lambda: None) is None
    assert store.operations == 0


def test_a_ps_task_ends_with_the_verdict_an_abort_carries(tmp_path) -> None:
    store, exits = dist.HashStore(), {}
    verdict = {"kind": "missing", "caller": 0, "operation": OP, "fix": FIX, "waited_s": 3.0, "missing": 1,
               "where": "waits 3.0 s in towers call #56 ps push"}
    store.set("abort", json.dumps({"rank": 1, "verdict": verdict}))
    ps = Progress()
    ps.role = "ps"
    dog = Watchdog(ProcessInfo(rank=2, world_size=3, master_port=1234), store, min_s=60.0, report_dir=tmp_path,
                   progress=ps, exit=lambda code: exits.setdefault(2, code), hold_main_thread=False)
    assert dog.check_s == 2.0  # a ps task looks at the job's end every 2 s, not every 10
    assert dog.tick(time.monotonic()) is True
    assert exits == {2: 1} and not list(tmp_path.iterdir())  # exit 1 with the error, no stuck report
