"""The stuck-job watchdog without processes: progress tracking, the bound, the verdict, the store protocol."""

from __future__ import annotations

import re
import threading

import pytest

from towers.cluster import from_env
from towers.cluster.base import ClusterConfigError
from towers.cluster.info import ProcessInfo
from towers.diagnostics.progress import Progress, flight_recorder_position
from towers.diagnostics.report import STUCK_EXIT_CODE, build_report, verdict
from towers.diagnostics.watchdog import Watchdog

NOW = 1000.0


def _snap(rank: int, *, waiting: bool, seq: int, calls: int, call: str | None = None, pending: bool = False,
          role: str = "worker", kind: str = "allreduce", time: float = NOW) -> dict:
    fr = {"seq": seq, "kind": kind, "done": not pending, "since": NOW - 5, "pending_seq": seq if pending else None,
          "pending_kind": kind if pending else None, "sizes": [[1]]}
    return {"rank": rank, "role": role, "pid": 100 + rank, "host": "h", "time": time, "steps": 3, "step_s": 0.02,
            "bound_s": 3.0, "min_s": 3.0, "factor": 10.0, "calls": calls, "call": call, "last_call": call or "x",
            "waiting": waiting, "since": NOW - 5 if waiting else None, "collective": fr}


def test_a_rank_that_does_not_answer_is_named_stopped():
    snaps = {0: _snap(0, waiting=True, seq=14, calls=4, pending=True), 1: _snap(1, waiting=False, seq=13, calls=4,
                                                                                 time=NOW - 7)}
    named, lines = verdict(snaps, {0}, 2, NOW)
    assert named == [1]
    assert lines[0].startswith("rank 1 did not answer: stopped or hung in C code (its last heartbeat is 7.0 s old")


def test_a_rank_outside_every_collective_while_others_wait_is_named():
    snaps = {0: _snap(0, waiting=True, seq=14, calls=4, pending=True), 1: _snap(1, waiting=False, seq=13, calls=4)}
    named, lines = verdict(snaps, {0, 1}, 2, NOW)
    assert named == [1]
    assert lines == ["rank 1 is not in any collective while rank(s) 0 wait: it loops, computes or blocks outside "
                     "towers (last finished collective #13 (allreduce) and towers call #4 x); see its stack below."]


def test_two_ranks_in_different_collectives_are_both_named_with_who_is_ahead():
    snaps = {0: _snap(0, waiting=True, seq=13, calls=7, call="strategy.barrier"),
             1: _snap(1, waiting=True, seq=14, calls=6, pending=True)}
    named, lines = verdict(snaps, {0, 1}, 2, NOW)
    assert named == [0, 1]
    assert lines[0].startswith("ranks 0, 1 disagree on the next collective")
    assert lines[1].startswith("rank 0 is behind: it waits in towers call #7 strategy.barrier")
    assert lines[2].startswith("rank 1 is ahead: it waits in collective #14 (allreduce), which rank(s) 0 never entered")


def test_with_three_ranks_the_odd_one_out_is_named():
    snaps = {r: _snap(r, waiting=True, seq=14, calls=5, pending=True, call="strategy.reduce('sum')") for r in (0, 2)}
    snaps[1] = _snap(1, waiting=True, seq=15, calls=5, pending=True)  # one step more
    named, lines = verdict(snaps, {0, 1, 2}, 3, NOW)
    assert named == [1]
    assert lines == ["rank 1 is ahead: it waits in collective #15 (allreduce), which rank(s) 0, 2 never entered (it "
                     "ran one step more, or they skipped a collective)."]


def test_when_every_worker_waits_in_the_same_request_the_ps_is_pointed_at():
    snaps = {r: _snap(r, waiting=True, seq=2, calls=9, call="ps push") for r in (0, 1)}
    snaps[2] = _snap(2, waiting=False, seq=2, calls=0, role="ps")
    named, lines = verdict(snaps, {0, 1, 2}, 3, NOW)
    assert named == [2]
    assert "look at the parameter server(s) 2" in lines[0]


def test_report_has_headline_places_and_stacks():
    snaps = {0: _snap(0, waiting=True, seq=14, calls=4, pending=True), 1: _snap(1, waiting=False, seq=13, calls=4)}
    text = build_report(trigger=snaps[0], snaps=snaps, stacks={0: "Thread MainThread (most recent call last):\n  x"},
                        world_size=2, now=NOW)
    assert text.startswith("towers: the job is stuck. Rank 0 waits 5.0 s in collective #14 (allreduce), past the "
                           "bound of 3.0 s = max(3 s, 10 x the slowest recent step 0.020 s). Every rank exits with "
                           f"code {STUCK_EXIT_CODE}.\nStuck: rank 1.\n")
    assert "  rank 1 (worker, pid 101 on h): step 3, slowest recent step 0.020 s; runs outside any collective" in text
    assert "[did not answer]" in text
    assert text.endswith("--- rank 1 ---\n(no stack: the rank did not answer: stopped or hung in C code)\n")


def test_progress_counts_outermost_calls_and_measures_steps():
    progress = Progress()
    progress.enter("strategy.reduce('sum')")
    progress.enter("ps gather")
    assert progress.calls == 1 and progress.stack == ["strategy.reduce('sum')", "ps gather"]
    progress.exit()
    progress.exit()
    assert progress.open_since is None and progress.last_call == "strategy.reduce('sum')"
    assert progress.slowest_recent_step_s() is None
    for _ in range(3):
        progress.on_step()
    assert progress.steps == 3 and len(progress.step_times) == 2


def test_report_says_when_the_bound_had_no_step_time_yet():
    trigger = {**_snap(0, waiting=True, seq=3, calls=1, call="strategy.barrier"), "step_s": None, "bound_s": 15.0}
    text = build_report(trigger=trigger, snaps={0: trigger}, stacks={0: "x"}, world_size=1, now=NOW)
    assert "past the bound of 15.0 s = 5 x 3 s, as no step was measured yet." in text
    assert "step 3, no step measured;" in text


def test_bound_is_the_floor_or_ten_slowest_steps():
    progress = Progress()
    watchdog = Watchdog(ProcessInfo(rank=0, world_size=2, master_port=1234), _Store(), min_s=3.0, progress=progress)
    assert watchdog.bound_s() == 15.0  # no step measured yet: 5 x the floor
    progress.step_times.append(0.01)
    assert watchdog.bound_s() == 3.0
    progress.step_times.extend([0.1, 0.5, 0.2])
    assert watchdog.bound_s() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="min_s must be > 0"):
        Watchdog(ProcessInfo(), _Store(), min_s=0)


def test_flight_recorder_position_numbers_by_the_default_group_and_waits_on_any():
    entries = [
        {"collective_seq_id": 7, "profiling_name": "gloo:all_reduce", "retired": True, "time_created_ns": 1_000_000_000,
         "is_p2p": False, "process_group": ["0", "default_pg"]},
        {"collective_seq_id": 8, "profiling_name": "gloo:broadcast", "retired": False, "time_created_ns": 2_000_000_000,
         "is_p2p": False, "process_group": ["0", "default_pg"]},
        {"collective_seq_id": 99, "profiling_name": "gloo:all_reduce", "retired": False, "time_created_ns": 1,
         "is_p2p": False, "process_group": ["3", "other"]},
    ]
    pos = flight_recorder_position(lambda: entries)
    assert pos is not None  # the oldest unfinished collective is the sub-group's
    assert (pos["seq"], pos["done"], pos["pending_seq"], pos["pending_kind"]) == (8, False, 99, "all_reduce on group other")
    assert flight_recorder_position(lambda: entries[:2])["since"] == 2.0  # type: ignore[index]
    assert flight_recorder_position(lambda: []) is None
    p2p = [{**entries[0], "is_p2p": True, "retired": False}]
    assert flight_recorder_position(lambda: p2p) is None


def test_stuck_timeout_comes_from_the_environment():
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert from_env(base).stuck_timeout_s is None
    assert from_env({**base, "TOWERS_STUCK_TIMEOUT_S": "5"}).stuck_timeout_s == 5.0
    assert from_env({**base, "TOWERS_STUCK_TIMEOUT_S": "0"}).stuck_timeout_s == 0.0
    with pytest.raises(ClusterConfigError, match="TOWERS_STUCK_TIMEOUT_S must be a number of seconds >= 0"):
        from_env({**base, "TOWERS_STUCK_TIMEOUT_S": "-1"})


class _Store:
    """The few TCPStore calls the watchdog makes, over a dict shared by threads."""

    def __init__(self) -> None:
        self.data: dict[str, str | int] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value

    def get(self, key: str) -> bytes:
        with self.lock:
            return str(self.data[key]).encode()

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.data[key] = int(self.data.get(key, 0)) + amount
            return int(self.data[key])


def test_two_watchdogs_agree_on_one_report_and_both_exit(tmp_path):
    store, exits = _Store(), {}
    done = threading.Barrier(3, timeout=30)
    waiting, looping = Progress(), Progress()
    waiting.enter("strategy.barrier")
    waiting.open_since -= 10  # type: ignore[operator]  # it has waited 10 s: past the 1 s bound
    waiting.step_times.append(0.01)

    def exit_for(rank: int):
        def record(code: int) -> None:
            exits[rank] = code
            done.wait()
        return record

    dogs = [Watchdog(ProcessInfo(rank=r, world_size=2, master_port=1234), store, min_s=1.0, poll_s=0.02,
                     answer_s=2.0, report_dir=tmp_path, progress=p, exit=exit_for(r), hold_main_thread=False)
            for r, p in ((0, waiting), (1, looping))]
    for dog in dogs:
        dog.start()
    done.wait()
    assert exits == {0: STUCK_EXIT_CODE, 1: STUCK_EXIT_CODE}
    report = dogs[0].report
    assert report is not None and report == dogs[1].report
    assert "Stuck: rank 1.\n  rank 1 is not in any collective while rank(s) 0 wait" in report
    assert re.search(r"Rank 0 waits \d+\.\d s in towers call #1 strategy\.barrier, past the bound of 1\.0 s", report)
    assert [p.name for p in tmp_path.iterdir()] == ["towers-stuck-1234-attempt0-rank0.txt"]
