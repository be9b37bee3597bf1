"""towers.cluster.rendezvous: waiting is visible and bounded, a bad address fails at once (no torch, fake clock)."""

from __future__ import annotations

import errno
import socket
import time

import pytest

from towers.cluster.rendezvous import (
    JOIN_HINT,
    JoinTimeoutError,
    Member,
    RendezvousError,
    join,
    report_interval_s,
    resolve,
    visible_warning,
    wait_reachable,
)


class FakeStore:
    """The store methods ``join`` uses, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def arrive(store: FakeStore, i: int, record: str, scope: str = "") -> None:
    """What member ``i``'s own ``join`` writes before it waits: its record, and its place in the arrival logs."""
    store.set(f"join/member/{i}", record)
    for log in ["all"] + ([f"scope/{scope}"] if scope else []):
        n = store.add(f"join/log/{log}/n", 1)
        store.set(f"join/log/{log}/{n}", str(i))


def names(i: int) -> str:
    return f"rank {i} (worker:{i} at h{i}:2222)"


def test_the_report_interval_is_15_s_and_shorter_for_short_timeouts():
    assert report_interval_s(300) == 15.0 and report_interval_s(8) == 2.0 and report_interval_s(2) == 1.0


def test_join_returns_every_member_once_all_joined():
    store = FakeStore()
    for i in (1, 2):  # the others joined before the chief
        arrive(store, i, f'{{"host": "h{i}", "address": "10.0.0.{i}", "pid": {i}}}')
    clock = FakeClock()
    members = join(store, index=0, count=3, is_chief=True, timeout_s=30, where="h0:2222", describe=names,
                   report=pytest.fail, me=Member("h0", "10.0.0.9", 7), clock=clock, sleep=clock.sleep)
    assert members == {0: Member("h0", "10.0.0.9", 7), 1: Member("h1", "10.0.0.1", 1), 2: Member("h2", "10.0.0.2", 2)}
    assert store.get("join/verdict") == b"complete"


def test_the_chief_reports_who_joined_and_who_is_missing_then_stops_at_the_timeout():
    store, clock, reports = FakeStore(), FakeClock(), []
    arrive(store, 2, '{"host": "h2", "address": "10.0.0.2", "pid": 22}')
    with pytest.raises(JoinTimeoutError) as err:
        join(store, index=0, count=3, is_chief=True, timeout_s=60, where="h0:2222", describe=names,
             report=reports.append, me=Member("h0", "10.0.0.9", 7), since=0.0, clock=clock, sleep=clock.sleep)
    assert clock.now - 1000.0 == pytest.approx(60, abs=0.5)  # bounded by the join timeout
    assert len(reports) == 3  # every 15 s: at 15, 30, 45 s
    assert reports[0].startswith("waiting for 1 of 3 processes to join the rendezvous at h0:2222 (15 s of the 60 s")
    for line in reports:
        assert "joined: rank 0 (worker:0 at h0:2222) [host h0 10.0.0.9, pid 7]; rank 2 (worker:2 at h2:2222) " \
               "[host h2 10.0.0.2, pid 22]; missing: rank 1 (worker:1 at h1:2222)" in line
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("1 of 3 processes did not join the rendezvous at h0:2222 within the join timeout of 60 s "
                              "(waiting since 00:00:00 UTC)")
    assert "missing: rank 1 (worker:1 at h1:2222)" in message and message.endswith(JOIN_HINT)
    assert "--join-timeout" in message and "TOWERS_JOIN_TIMEOUT_S" in message
    assert err.value.missing == (1,)
    assert store.get("join/verdict").decode() == message  # the others stop with the same line


def test_the_others_stop_with_the_chiefs_verdict_and_say_nothing_while_waiting():
    store, clock = FakeStore(), FakeClock()
    store.set("join/verdict", "1 of 3 processes did not join ...")
    with pytest.raises(JoinTimeoutError, match=r"^1 of 3 processes did not join \.\.\.$"):
        join(store, index=1, count=3, is_chief=False, timeout_s=60, where="h0:2222", describe=names,
             report=pytest.fail, clock=clock, sleep=clock.sleep)


def test_a_member_without_the_chief_verdict_gives_up_shortly_after_its_own_timeout():
    store, clock = FakeStore(), FakeClock()
    with pytest.raises(JoinTimeoutError, match="2 of 3 processes did not join"):
        join(store, index=1, count=3, is_chief=False, timeout_s=4, where="h0:2222", describe=names,
             report=pytest.fail, clock=clock, sleep=clock.sleep)
    assert 4 <= clock.now - 1000.0 <= 6.5


def test_a_member_that_died_ends_the_wait_at_once_and_the_chief_tells_the_others():
    store, clock = FakeStore(), FakeClock()
    arrive(store, 1, '{"host": "h1", "address": "10.0.0.1", "pid": 11, "scope": "boot:ns"}', scope="boot:ns")
    seen: list[dict] = []

    def dead(joined):
        seen.append(dict(joined))
        return "rank 1 (worker:1 at h1:2222) died during start-up (...)" if 1 in joined else None

    with pytest.raises(RendezvousError, match=r"^rank 1 \(worker:1 at h1:2222\) died during start-up"):
        join(store, index=0, count=3, is_chief=True, timeout_s=60, where="h0:2222", describe=names,
             report=pytest.fail, me=Member("h0", "10.0.0.9", 7), clock=clock, sleep=clock.sleep, dead=dead)
    assert clock.now == 1000.0  # at once, not at the join timeout
    assert seen[0][1] == Member("h1", "10.0.0.1", 11, "boot:ns")  # the record's pid scope is read back
    with pytest.raises(RendezvousError, match="rank 1 .* died during start-up"):  # the others end with the same line
        join(store, index=2, count=3, is_chief=False, timeout_s=60, where="h0:2222", describe=names,
             report=pytest.fail, clock=clock, sleep=clock.sleep)


class CountingStore(FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def set(self, key, value):
        self.calls += 1
        super().set(key, value)

    def check(self, keys):
        self.calls += 1
        return super().check(keys)

    def get(self, key):
        self.calls += 1
        return super().get(key)

    def add(self, key, amount):
        self.calls += 1
        return super().add(key, amount)


@pytest.mark.parametrize("is_chief", [True, False])
def test_a_poll_costs_the_same_few_store_calls_whatever_the_number_of_members(is_chief):
    """A start-up of 16k ranks: each waiting member's poll must not read every member still missing (O(N^2) in all).

    Half of the members arrived (4 per host), the other half never do: each member waits out its timeout.
    What grows with the members is only reading each arrival once (the chief: all of them; the others: their
    host's) and, at the timeout, one read of every record to name the missing."""
    per_poll = {}
    for count in (64, 4096):
        store, clock = CountingStore(), FakeClock()
        for i in range(1, count // 2):
            arrive(store, i, f'{{"host": "h", "address": "", "pid": {i}, "scope": "boot:{i // 4}"}}', f"boot:{i // 4}")
        store.calls = 0
        with pytest.raises(JoinTimeoutError):
            join(store, index=0 if is_chief else 4, count=count, is_chief=is_chief, timeout_s=10, where="h0:1",
                 describe=names, report=lambda line: None, me=Member("h", "", 99, "boot:1"), clock=clock,
                 sleep=clock.sleep)
        once = 4 * (count // 2) if is_chief else 2 * count  # each arrival read once / each record read at the end
        per_poll[count] = (store.calls - once) / (10 / 0.25)
    assert per_poll[4096] <= per_poll[64] + 1 and per_poll[4096] < 10, per_poll


def test_two_members_with_the_same_rank_are_refused():
    store, clock = FakeStore(), FakeClock()
    store.add("join/claims/1", 1)
    with pytest.raises(RendezvousError, match=r"two nodes claim to be node 1 .*--node-rank"):
        join(store, index=1, count=2, is_chief=False, timeout_s=10, where="h0:1", describe=lambda i: f"node {i}",
             report=print, kind="node", clock=clock, sleep=clock.sleep)


def test_an_unresolvable_host_fails_at_once_in_one_line():
    started = time.monotonic()
    with pytest.raises(RendezvousError) as err:
        resolve("no-such-host.invalid", 29500, what="--rdzv-endpoint")
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "\n" not in message and "'no-such-host.invalid' (--rdzv-endpoint) does not resolve" in message


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_a_refused_port_is_waited_for_with_reports_until_the_timeout():
    reports: list[str] = []
    started = time.monotonic()
    with pytest.raises(JoinTimeoutError) as err:
        wait_reachable("127.0.0.1", _closed_port(), timeout_s=2.5, what="MASTER_ADDR/MASTER_PORT",
                       awaited="the chief, rank 0,", report=reports.append)
    assert 2.5 <= time.monotonic() - started < 6
    assert reports and all("waiting for the chief, rank 0, to open the rendezvous 127.0.0.1:" in r for r in reports)
    assert "connection refused for" in reports[0]
    assert "did not open the rendezvous" in str(err.value) and "within the join timeout of 2.5 s" in str(err.value)


def test_the_address_of_a_listening_port_is_returned():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert wait_reachable("127.0.0.1", server.getsockname()[1], timeout_s=5, what="x", awaited="y",
                              report=pytest.fail) == "127.0.0.1"


@pytest.mark.parametrize("failure, expected", [
    (OSError(errno.EHOSTUNREACH, "No route to host"), "is unreachable from this host: No route to host"),
    (socket.timeout("timed out"), "did not answer within 3 s"),
])
def test_an_unreachable_host_fails_at_once(failure, expected):
    def connect(*_args, **_kwargs):
        raise failure

    clock = FakeClock()
    with pytest.raises(RendezvousError, match=expected) as err:
        wait_reachable("127.0.0.1", 29500, timeout_s=300, what="MASTER_ADDR", awaited="the chief", report=pytest.fail,
                       clock=clock, sleep=clock.sleep, connect=connect)
    assert not isinstance(err.value, JoinTimeoutError) and clock.now == 1000.0  # no waiting, no retry


def test_a_waiting_line_is_printed_when_no_logging_is_set_up_and_logged_when_it_is(capsys):
    import logging

    logger = logging.getLogger("test_rendezvous_visible")  # outside towers.*: no handler another test installed
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []  # an application that set up no logging (pytest's own capture handlers removed)
    try:
        visible_warning(logger, prefix="[rank 0/2] towers:")("waiting for rank 1")
        assert capsys.readouterr().err == "[rank 0/2] towers: waiting for rank 1\n"
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        root.addHandler(handler)
        visible_warning(logger)("waiting for rank 1")
        assert capsys.readouterr().err == "" and [r.getMessage() for r in records] == ["waiting for rank 1"]
    finally:
        root.handlers = saved


def test_reachability_is_checked_from_the_chosen_interface_address():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert wait_reachable("127.0.0.1", port, timeout_s=5, what="x", awaited="y", report=pytest.fail,
                              source_address="127.0.0.1") == "127.0.0.1"
        with pytest.raises(RendezvousError, match=r"from 198\.51\.100\.77, the address of the job's network interface"):
            wait_reachable("127.0.0.1", port, timeout_s=5, what="x", awaited="y", report=pytest.fail,
                           source_address="198.51.100.77")  # TEST-NET-2: not an address of this host
