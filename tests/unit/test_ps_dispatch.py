"""ps task 0's batch dispatcher without processes: own shares first, a dead worker's shares to the others, equal steps."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from towers.data import global_batch_sizes, shard_bounds
from towers.strategies.parameter_server.dispatch import Dispatcher, _Shape
from towers.strategies.parameter_server.requests import RequestError


class WouldWait(Exception):
    pass


class FakeServer:
    """What the dispatcher reads of a ParameterServer: the lock and the live workers."""

    def __init__(self, workers: int):
        self.cond = threading.Condition()
        self.links = [None] * workers
        self.dead: dict[int, str] = {}
        self.wait_s = 0.0  # > 0: wait like the ps does (for requests asked together, in threads)

    def active(self) -> set[int]:
        return {w for w in range(len(self.links)) if w not in self.dead}

    def wait(self, ready: Any, what: str, missing: Any) -> None:
        if not self.cond.wait_for(ready, timeout=self.wait_s):
            raise WouldWait(f"{what} waits for {sorted(missing())}")

    def kill(self, dispatcher: Dispatcher, w: int) -> None:
        self.dead[w] = "killed"
        dispatcher.on_dead(w)


def apply(d: Dispatcher, w: int, *units: tuple[int, int], key: str = "d1.1") -> None:
    """Worker ``w``'s push naming ``units`` (global batch, replica) was applied on ps 0."""
    d.applied(w, [[key, g, r] for g, r in units])


def spec(n: int = 10, b: int = 4, workers: int = 2, start: int = 0) -> dict[str, Any]:
    return {"num_examples": n, "global_batch_size": b, "drop_remainder": False, "start": start, "epoch": 0,
            "num_replicas": workers}


def ask(d: Dispatcher, w: int, step: int, key: str = "d1.1", **kw: Any) -> tuple:
    answer = d.next(w, {"key": key, "step": step, "spec": spec(**kw)})
    if answer["kind"] == "unit":
        assert len(answer["units"]) == 1, answer
        return ("unit", *answer["units"][0])
    return ("empty", None, None) if answer["kind"] == "empty" else ("stop", answer["examples"], answer["expected"])


def ask_together(d: Dispatcher, requests: list[tuple[int, int]], **kw: Any) -> list[tuple]:
    """Ask ``(worker, step)`` requests at once, each in its own thread, as their link threads on ps 0 would."""
    d.server.wait_s = 10.0
    answers: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i, w=w, s=s: answers.__setitem__(i, ask(d, w, s, **kw)))
               for i, (w, s) in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    d.server.wait_s = 0.0
    return [answers.get(i) for i in range(len(requests))]


def unit_sizes(s: dict[str, Any]) -> list[list[int]]:
    shape = _Shape(s)
    return [[shape.share(g, r) for r in range(shape.replicas)] for g in range(shape.batches)]


def test_unit_sizes_match_the_static_split():
    assert unit_sizes(spec(10, 4, 3)) == [[2, 1, 1], [2, 1, 1], [1, 1, 0]]
    static = [[b - a for a, b in (shard_bounds(size, 3, r) for r in range(3))] for size in global_batch_sizes(10, 4)]
    assert unit_sizes(spec(10, 4, 3)) == static


def test_every_worker_alive_gets_exactly_its_static_shares_then_stops_at_the_same_step():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    for step, g in enumerate(range(3)):  # 10 examples in batches of 4: 3 global batches
        assert ask(d, 0, step) == ("unit", g, 0)
        assert ask(d, 1, step) == ("unit", g, 1)
        apply(d, 0, (g, 0))
        apply(d, 1, (g, 1))
    assert ask_together(d, [(0, 3), (1, 3)]) == [("stop", 10, 10)] * 2


def test_a_dead_workers_unapplied_and_remaining_shares_go_to_the_survivors():
    server = FakeServer(3)
    d = Dispatcher(server, lease=1)
    kw = {"n": 12, "b": 3, "workers": 3}  # 4 global batches of 3: one example per share
    for w in range(3):
        assert ask(d, w, 0, **kw) == ("unit", 0, w)
    for w in range(3):
        apply(d, w, (0, w))  # step 0 applied everywhere
    for w in range(3):
        assert ask(d, w, 1, **kw) == ("unit", 1, w)
    apply(d, 0, (1, 0))
    apply(d, 1, (1, 1))  # worker 2 dies before its push of step 1 reached ps 0
    server.kill(d, 2)
    got = [ask(d, w, s, **kw) for s in (2, 3, 4) for w in (0, 1)]
    assert got[:4] == [("unit", 2, 0), ("unit", 2, 1), ("unit", 3, 0), ("unit", 3, 1)]
    # then the orphans, in order: (1, 2) unapplied, (2, 2) and (3, 2) never handed out
    assert got[4:] == [("unit", 1, 2), ("unit", 2, 2)]
    assert ask(d, 0, 5, **kw) == ("unit", 3, 2)
    assert ask(d, 1, 5, **kw) == ("empty", None, None)  # worker 0 still works at step 5: same step count
    assert ask_together(d, [(0, 6), (1, 6)], **kw) == [("stop", 12, 12)] * 2


def test_an_applied_share_of_a_dead_worker_is_not_handed_out_again():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    assert ask(d, 0, 0) == ("unit", 0, 0) and ask(d, 1, 0) == ("unit", 0, 1)
    apply(d, 0, (0, 0))
    apply(d, 1, (0, 1))  # both pushes applied, then worker 1 dies between steps
    server.kill(d, 1)
    assert [ask(d, 0, s)[1:] for s in (1, 2, 3, 4)] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    assert ask(d, 0, 5) == ("stop", 10, 10)


def test_an_evaluation_pass_hands_every_share_of_a_dead_worker_out_again():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)  # no push between the steps: nothing is applied
    assert ask(d, 0, 0) == ("unit", 0, 0) and ask(d, 1, 0) == ("unit", 0, 1)
    assert ask(d, 1, 1) == ("unit", 1, 1)
    server.kill(d, 1)
    assert [ask(d, 0, s)[1:] for s in (1, 2, 3, 4, 5)] == [(1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert ask(d, 0, 6) == ("stop", 10, 10)


def test_a_worker_ahead_waits_for_the_others_and_a_worker_behind_gets_empty_steps():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    kw = {"n": 8, "b": 4}  # 2 global batches
    assert ask(d, 0, 0, **kw)[0] == "unit" and ask(d, 0, 1, **kw)[0] == "unit"
    with pytest.raises(WouldWait, match=r"step 2 waits for \[1\]"):
        ask(d, 0, 2, **kw)  # its shares are done; worker 1 may still die and leave some
    assert ask(d, 1, 0, **kw)[0] == "unit" and ask(d, 1, 1, **kw)[0] == "unit"
    apply(d, 0, (0, 0), (1, 0))
    apply(d, 1, (0, 1), (1, 1))
    assert ask_together(d, [(0, 2), (1, 2)], **kw) == [("stop", 8, 8)] * 2


def test_workers_that_disagree_on_a_pass_get_an_error_naming_both_specs():
    d = Dispatcher(FakeServer(2), lease=1)
    ask(d, 0, 0)
    with pytest.raises(RequestError, match="same dataset size, global_batch_size") as err:
        ask(d, 1, 0, n=11)
    assert "'num_examples': 11" in str(err.value) and "'num_examples': 10" in str(err.value)


def test_a_pass_started_after_a_worker_died_gives_its_shares_to_the_others_from_the_start():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    server.kill(d, 1)
    assert [ask(d, 0, s)[1:] for s in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert ask(d, 0, 6) == ("stop", 10, 10)


def test_a_worker_waiting_at_the_end_takes_the_share_of_a_worker_that_dies_meanwhile():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    kw = {"n": 8, "b": 4}
    for s in (0, 1):
        assert ask(d, 0, s, **kw) == ("unit", s, 0) and ask(d, 1, s, **kw) == ("unit", s, 1)
        apply(d, 0, (s, 0))
    apply(d, 1, (0, 1))  # worker 1's last share (1, 1) is not applied yet
    server.wait_s = 10.0
    answer: list[tuple] = []
    waiter = threading.Thread(target=lambda: answer.append(ask(d, 0, 2, **kw)))
    waiter.start()
    with server.cond:  # worker 0 is waiting (it asked) before worker 1 dies
        assert server.cond.wait_for(lambda: d.passes["d1.1"].asked.get(0) == 2, timeout=10)
        server.kill(d, 1)
        server.cond.notify_all()
    waiter.join(20)
    assert answer == [("unit", 1, 1)]
    apply(d, 0, (1, 1))
    server.wait_s = 0.0
    assert ask(d, 0, 3, **kw) == ("stop", 8, 8)


def test_a_batch_fetched_ahead_and_not_run_is_handed_out_again_when_its_worker_dies():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    assert ask(d, 0, 0) == ("unit", 0, 0) and ask(d, 1, 0) == ("unit", 0, 1)
    assert ask(d, 1, 1) == ("unit", 1, 1)  # worker 1 prefetches its next batch ...
    apply(d, 1, (0, 1))  # ... then its push of the first one is applied
    server.kill(d, 1)  # dies before running the prefetched batch
    assert [ask(d, 0, s)[1:] for s in (1, 2, 3, 4)] == [(1, 0), (2, 0), (1, 1), (2, 1)]


def test_a_model_without_dense_parameters_acknowledges_its_batches_apart():
    server = FakeServer(2)
    d = Dispatcher(server, lease=1)
    assert ask(d, 1, 0) == ("unit", 0, 1)
    assert d.next(1, {"applied": [["d1.1", 0, 1]]}) == {}
    assert (0, 1) not in d.passes["d1.1"].held and d.passes["d1.1"].done == 2  # applied: its 2 examples count


def test_own_shares_go_out_several_at_a_time_and_a_dead_workers_one_at_a_time():
    server = FakeServer(2)
    d = Dispatcher(server, lease=4)
    kw = {"n": 20, "b": 2}  # 10 global batches
    first = d.next(0, {"key": "d1.1", "step": 0, "spec": spec(**kw)})
    assert first == {"kind": "unit", "units": [[0, 0], [1, 0], [2, 0], [3, 0]]}
    lease = d.next(1, {"key": "d1.1", "step": 0, "spec": spec(**kw)})["units"]
    apply(d, 1, *(tuple(u) for u in lease[:2]))  # ran two of its four, then died
    server.kill(d, 1)
    assert d.next(0, {"key": "d1.1", "step": 4, "spec": spec(**kw)})["units"] == [[4, 0], [5, 0], [6, 0], [7, 0]]
    assert d.next(0, {"key": "d1.1", "step": 8, "spec": spec(**kw)})["units"] == [[8, 0], [9, 0]]
    orphans = [d.next(0, {"key": "d1.1", "step": s, "spec": spec(**kw)})["units"] for s in range(10, 18)]
    assert orphans == [[[g, 1]] for g in range(2, 10)]  # its unrun lease and its remaining shares, one by one
    assert ask(d, 0, 18, **kw) == ("stop", 20, 20)


def test_a_pushs_one_batch_rides_in_the_header_ints_and_anything_else_in_the_json():
    from towers.strategies.parameter_server.dispatch import pack_unit, unpack_unit

    assert pack_unit([["d3.7", 5, 1]]) == (3, 7, 5, 1) and unpack_unit((3, 7, 5, 1)) == [["d3.7", 5, 1]]
    assert pack_unit([["d3.7", 5, 1], ["d3.7", 6, 1]]) is None  # several: JSON
    assert pack_unit([]) is None and pack_unit(None) is None and unpack_unit((0, 0, 0, 0)) is None
    assert pack_unit([["custom", 1, 2]]) is None


def test_passes_left_unfinished_are_dropped_after_many_newer_ones_and_named_if_asked_again():
    from towers.strategies.parameter_server import dispatch

    d = Dispatcher(FakeServer(2), lease=1)
    for i in range(dispatch._MAX_OPEN + 3):  # each pass read one step deep, like steps_per_epoch=1
        assert ask(d, 0, 0, key=f"d1.{i}")[0] == "unit"
    assert len(d.passes) == dispatch._MAX_OPEN
    with pytest.raises(RequestError, match="d1.0 was left unfinished and dropped"):
        ask(d, 1, 0, key="d1.0")


def test_a_pass_of_millions_of_batches_costs_no_memory_per_batch():
    server = FakeServer(4)
    d = Dispatcher(server, lease=2)
    kw = {"n": 10_000_000_000, "b": 8, "workers": 4}  # 1.25e9 global batches
    assert d.next(0, {"key": "d1.1", "step": 0, "spec": spec(**kw)})["units"] == [[0, 0], [1, 0]]
    p = d.passes["d1.1"]
    server.kill(d, 3)  # its whole remaining share becomes one range, not a billion entries
    assert list(p.orphans) == [[0, 1_250_000_000, 3]] and len(p.held) == 2
    assert p.shape.expected() == 10_000_000_000
    assert unit_sizes(spec(10, 4, 3)) == [[2, 1, 1], [2, 1, 1], [1, 1, 0]]
