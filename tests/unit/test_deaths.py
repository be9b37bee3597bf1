"""towers.cluster.deaths: a process that dies during start-up is named at once (fake store, real child processes)."""

from __future__ import annotations

import subprocess
import sys
import threading

from towers.cluster.deaths import StartupWatch, pid_scope, process_gone, publish_death, read_deaths
from towers.cluster.rendezvous import Member


class FakeStore:
    """The store methods the watch uses, on a dict (one lock: the watch's thread and the test share it)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value) -> None:
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value


def names(i: int) -> str:
    return f"rank {i} (worker:{i})"


def ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def make_watch(store: FakeStore, lines: list[str], exits: list[int], **kwargs) -> StartupWatch:
    return StartupWatch(index=0, count=3, describe=names, report=lines.append, store_factory=lambda: store,
                        timeout_s=kwargs.pop("timeout_s", 300.0), poll_s=0.01, grace_s=kwargs.pop("grace_s", 0.05),
                        exit_process=exits.append, **kwargs)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not met in time")


def test_a_live_process_is_not_gone_and_an_ended_or_unreaped_one_is():
    import os

    assert not process_gone(os.getpid())
    assert process_gone(ended_pid())
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: process_gone(zombie.pid))  # exited, not reaped yet: a zombie counts as dead
    zombie.wait()


def test_deaths_published_in_the_store_are_read_back_by_index():
    store = FakeStore()
    assert read_deaths(store, 3) == {}
    publish_death(store, 2, "was killed by SIGKILL")
    assert read_deaths(store, 3) == {2: "was killed by SIGKILL"}


def test_a_dead_member_on_this_host_is_named_and_a_blocked_caller_is_ended():
    store, lines, exits = FakeStore(), [], []
    watch = make_watch(store, lines, exits)
    here = pid_scope()
    watch.watch({0: Member("h", "", 1, here), 1: Member("h", "", ended_pid(), here)})
    watch.set_phase("creating the process group (gloo) of 3 processes")
    wait_until(lambda: exits == [1])
    assert watch.dead_index == 1
    assert watch.failure is not None and watch.failure.startswith(
        "rank 1 (worker:1) died during start-up (its process, pid ")
    assert "while this process was creating the process group (gloo) of 3 processes; the job cannot start " \
           "without it. Look for the first error in rank 1 (worker:1)'s output." in watch.failure
    assert lines[-1] == f"{watch.failure} This process stops."
    watch.stop()


def test_a_death_seen_by_a_caller_that_stops_the_watch_in_time_does_not_end_the_process():
    store, lines, exits = FakeStore(), [], []
    watch = make_watch(store, lines, exits, grace_s=30.0)
    publish_death(store, 2, "exited with code 3")  # across hosts: the dead member's supervisor said so
    watch.watch({})
    wait_until(lambda: watch.failure is not None)
    watch.stop()
    assert watch.failure.startswith("rank 2 (worker:2) died during start-up (exited with code 3)")
    assert exits == [] and lines == []


def test_a_member_that_finished_its_start_up_may_end_and_other_hosts_pids_are_not_judged():
    store, lines, exits = FakeStore(), [], []
    watch = make_watch(store, lines, exits, timeout_s=0.2)  # reports every second
    store.set("started/1", "1")
    watch.watch({1: Member("h", "", ended_pid(), pid_scope()), 2: Member("other", "", ended_pid(), "elsewhere")})
    watch.set_phase("connecting worker 0 (rank 0) <-> ps task 0 (rank 2)")
    wait_until(lambda: lines)
    watch.stop()
    assert watch.failure is None and exits == []
    assert lines[0].startswith("still connecting worker 0 (rank 0) <-> ps task 0 (rank 2) after 1 s; 2 of 3 processes "
                              "recorded, none known dead")
