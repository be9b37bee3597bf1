"""towers' control plane at 1k-16k ranks on one machine: the real store, towers' real code, simulated ranks.

What is real: one ``torch.distributed.TCPStore`` server (torch's default, libuv) in this process;
towers' own ``Watchdog`` (``tick``: heartbeat, abort check, the reporter's answer collection and
report), ``PreemptionHandler.should_save`` (notice, agreement on a step), ps task 0's
``Dispatcher``, torchft's lighthouse (``towers.launch.lighthouse.start_lighthouse``) and the start-up
rendezvous (``towers.cluster.rendezvous``: the chief and a sample of members run the real ``join``, the
others the real ``announce`` from the client processes).
What is simulated: a rank is an object, not a process. ``--procs`` client processes each drive
``N / procs`` ranks through one store client, one at a time; no model, no collective, no network
(loopback), no per-rank connection. Steady-state traffic runs in *virtual* time (each rank's
watchdog ticks every ``poll_s`` and its training loop reaches a step boundary every ``--step-s``
of job time, as fast as the store answers; the client processes meet at every step, as
collectives keep ranks within a step of each other): the count of store operations per second of job time
is what the code does; the store's capacity is measured first with a set/get/add loop from the
same client processes, so the share is an honest ratio. The stuck-rank latency runs in real
time: every simulated rank checks ``abort`` on its real schedule and answers with the real
``_answer``; one process per client reads the report for its ranks (the real protocol: each rank).

    python benchmarks/control_plane.py --ranks 1024 4096 16384
    python benchmarks/control_plane.py --ranks 1024 --legacy   # the cadence of the code before

Results go in BENCHMARKS.md ("Control plane at scale").
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import multiprocessing as mp
import signal
import statistics
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

OPS = ("set", "get", "check", "add", "compare_set")


class CountingStore:
    """A store proxy that counts each operation (by kind) and times it."""

    def __init__(self, store: Any):
        self.store, self.counts, self.lat = store, Counter(), []
        self.counting = True

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)
        if name not in OPS:
            return fn

        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            if self.counting:
                self.counts[name] += 1
                if len(self.lat) < 200_000:
                    self.lat.append(time.perf_counter() - t0)
            return out
        return call


def _client(port: int, prefix: str | None = None) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120), wait_for_workers=False)
    return dist.PrefixStore(prefix, store) if prefix else store


# --- the store's capacity ---------------------------------------------------------------------------
def _capacity_worker(port: int, seconds: float, i: int, out: Any) -> None:
    store = _client(port)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            store.set(f"cap/{i}/{n % 64}", b"x" * 64)
            store.get(f"cap/{i}/{n % 64}")
            store.add(f"cap/{i}/count", 1)
            n += 1
    out.put(3 * n)


def capacity(port: int, procs: int, seconds: float = 3.0) -> float:
    """Return the store's operations per second from ``procs`` client processes doing set/get/add."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_capacity_worker, args=(port, seconds, i, q)) for i in range(procs)]
    for p in ps:
        p.start()
    total = sum(q.get(timeout=seconds + 60) for _ in ps)
    for p in ps:
        p.join(10)
    return total / seconds


# --- steady state in virtual time -------------------------------------------------------------------
class _Handler:
    """Builds a ``PreemptionHandler`` that acts as installed (no signal taken: ranks share a process)."""

    @staticmethod
    def make(store: Any, rank: int, every: int) -> Any:
        from towers.checkpoint.preemption import PreemptionHandler

        class Simulated(PreemptionHandler):
            installed = True  # type: ignore[assignment]

        return Simulated(signals=(), store=store, rank=rank, every_steps=every)


def steady(port: int | None, ranks: range, world: int, *, seconds: float, step_s: float, legacy: bool,
           notice_at_s: float | None, store: Any = None, prefix: str = "run", procs: int = 1) -> dict[str, Any]:
    """Run ``ranks`` of a ``world``-rank job for ``seconds`` of job time; count store ops in the second half.

    Each rank has a real ``Watchdog`` (ticked every ``poll_s``) and a real ``PreemptionHandler``
    (``should_save`` at every step boundary). ``notice_at_s``: rank ``ranks[0]`` receives the notice then.
    """
    import torch.distributed as dist

    from towers.checkpoint.preemption import check_every_steps
    from towers.cluster.info import ProcessInfo
    from towers.diagnostics.progress import Progress
    from towers.diagnostics.watchdog import Watchdog

    raw = store if store is not None else _client(port)  # type: ignore[arg-type]
    wd = CountingStore(dist.PrefixStore(f"{prefix}/towers/attempt_0/watchdog", raw))
    pre = CountingStore(dist.PrefixStore(f"{prefix}/towers/attempt_0", raw))
    progress = Progress()
    sync = None
    if procs > 1:
        def sync(k: int) -> None:  # every process reaches job time k x step_s before any goes past it
            raw.add(f"{prefix}/sync/{k}", 1)
            while raw.add(f"{prefix}/sync/{k}", 0) < procs:
                time.sleep(0.001)
    dogs, handlers = {}, {}
    every = 1 if legacy else check_every_steps(world)
    for r in ranks:
        dog = Watchdog(ProcessInfo(rank=r, world_size=world, master_port=1), wd, progress=progress,
                       exit=lambda code: None, hold_main_thread=False)
        if legacy:  # the code before: a heartbeat and an abort check every poll
            dog.check_s = dog.beat_s = dog.poll_s
        dogs[r] = dog
        handlers[r] = _Handler.make(pre, r, every)
    poll_s = next(iter(dogs.values())).poll_s
    # events: (time, kind, rank); ranks start spread over one poll / one step
    n = len(dogs)
    events = [(i * poll_s / n, 0, r) for i, r in enumerate(dogs)] + [(i * step_s / n, 1, r) for i, r in enumerate(dogs)]
    heapq.heapify(events)
    steps = dict.fromkeys(dogs, 0)
    saved: dict[int, tuple[int, float]] = {}
    noticed = False
    half = seconds / 2
    wd.counting = pre.counting = False
    stop_counting = notice_at_s if notice_at_s is not None else seconds
    tick, wall_half, wall = 0, 0.0, 0.0
    while events:
        t, kind, r = heapq.heappop(events)
        if t >= seconds:
            break
        while sync is not None and t >= (tick + 1) * step_s:  # lockstep across processes, as collectives keep it
            tick += 1
            sync(tick)
        if not wd.counting and half <= t < stop_counting:
            wd.counting = pre.counting = True
            wall_half = time.perf_counter()
        if wd.counting and t >= stop_counting:
            wd.counting = pre.counting = False
            wall = time.perf_counter() - wall_half
        if notice_at_s is not None and not noticed and t >= notice_at_s and r == 0:
            noticed = True
            h = handlers[r]
            h.noticed, h.noticed_at_s = signal.SIGTERM, t
            h._store.set("towers/preemption/notice", f"{r}:SIGTERM")
        if kind == 0:
            dogs[r].tick(t)
            heapq.heappush(events, (t + poll_s, 0, r))
        else:
            steps[r] += 1
            if r not in saved and handlers[r].should_save(steps[r]):
                saved[r] = (steps[r], t)
            heapq.heappush(events, (t + step_s, 1, r))
    if wd.counting:
        wall = time.perf_counter() - wall_half
    counts = {"watchdog": wd.counts, "preemption": pre.counts}
    lat = wd.lat + pre.lat
    return {"ranks": n, "window_s": stop_counting - half, "counts": {k: dict(v) for k, v in counts.items()},
            "wall_s": wall, "lat": sorted(lat), "saved": saved, "every_steps": every,
            "poll_s": poll_s, "check_s": dogs[ranks[0]].check_s, "beat_s": dogs[ranks[0]].beat_s}


def _steady_worker(port: int, ranks: range, world: int, kw: dict[str, Any], out: Any) -> None:
    res = steady(port, ranks, world, **kw)
    res["lat"] = res["lat"][:: max(1, len(res["lat"]) // 5000)]
    out.put(res)


def run_steady(port: int, world: int, procs: int, **kw: Any) -> dict[str, Any]:
    """``steady`` over ``procs`` client processes; returns the summed counts and every rank's save step."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shares = [range(i * world // procs, (i + 1) * world // procs) for i in range(procs)]
    ps = [ctx.Process(target=_steady_worker, args=(port, s, world, {**kw, "procs": procs}, q)) for s in shares]
    for p in ps:
        p.start()
    parts = [q.get(timeout=3600) for _ in ps]
    for p in ps:
        p.join(10)
    return merge(parts)


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the counts of ``steady`` results over processes."""
    out = dict(parts[0])
    out["ranks"] = sum(p["ranks"] for p in parts)
    out["counts"] = {k: dict(sum((Counter(p["counts"][k]) for p in parts), Counter())) for k in parts[0]["counts"]}
    out["lat"] = sorted(x for p in parts for x in p["lat"])
    out["wall_s"] = max(p["wall_s"] for p in parts)
    out["saved"] = {r: s for p in parts for r, s in p["saved"].items()}
    return out


def per_rank_ops(res: dict[str, Any]) -> dict[str, float]:
    """Store operations per second of job time per rank, by component."""
    return {k: sum(v.values()) / res["window_s"] / res["ranks"] for k, v in res["counts"].items()}


# --- the stuck rank named, in real time ------------------------------------------------------------------
def _stuck_worker(port: int, ranks: range, world: int, go: Any, out: Any, prefix: str) -> None:
    import torch.distributed as dist

    from towers.cluster.info import ProcessInfo
    from towers.diagnostics.progress import Progress
    from towers.diagnostics.watchdog import Watchdog

    logging.getLogger("towers").addHandler(_Drop())
    store = dist.PrefixStore(f"{prefix}/watchdog", _client(port))
    progress = Progress()
    dogs = [Watchdog(ProcessInfo(rank=r, world_size=world, master_port=1), store, progress=progress,
                     exit=lambda code: None, hold_main_thread=False) for r in ranks]
    for dog in dogs:
        dog._next_beat = float("inf")  # heartbeats are not what this measures; they were written before
    go.wait()
    t0 = time.monotonic()
    for i, dog in enumerate(dogs):  # each rank's checks start at its own phase of check_s
        dog._next_check = t0 + dog.check_s * i / len(dogs)
    pending = list(dogs)
    seen_at = []
    while pending:
        now = time.monotonic()
        left = []
        for dog in pending:
            if now >= dog._next_check:
                if store.check(["abort"]):
                    dog._answer()
                    seen_at.append(time.time())
                    continue
                dog._next_check = now + dog.check_s
            left.append(dog)
        pending = left
        time.sleep(0.005)
    while not store.check(["report"]):  # every rank of the process reads the same report
        time.sleep(0.05)
    store.add("acks", len(dogs))
    out.put({"seen": seen_at, "read": time.time()})


class _Drop(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        pass


def stuck_latency(port: int, world: int, procs: int) -> dict[str, float]:
    """Rank 0 waits past its bound; return the seconds until every rank saw abort, until the report, until all read it."""
    import torch.distributed as dist

    from towers.cluster.info import ProcessInfo
    from towers.diagnostics.progress import Progress
    from towers.diagnostics.watchdog import Watchdog

    logging.getLogger("towers").addHandler(_Drop())
    prefix = f"stuck{world}"
    store = dist.PrefixStore(f"{prefix}/watchdog", _client(port))
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    shares = [range(1 + i * (world - 1) // procs, 1 + (i + 1) * (world - 1) // procs) for i in range(procs)]
    ps = [ctx.Process(target=_stuck_worker, args=(port, s, world, go, q, prefix)) for s in shares]
    for p in ps:
        p.start()
    stuck = Progress()
    stuck.enter("strategy.barrier")
    stuck.open_since -= 1e4  # type: ignore[operator]
    done = threading.Event()
    stamps: dict[str, float] = {}

    class Stamping(CountingStore):
        def __getattr__(self, name: str) -> Any:
            fn = super().__getattr__(name)
            if name != "set":
                return fn

            def stamped(key: str, value: Any) -> Any:
                out = fn(key, value)
                stamps.setdefault(key, time.time())
                return out
            return stamped

    reporter = Watchdog(ProcessInfo(rank=0, world_size=world, master_port=1), Stamping(store), progress=stuck,
                        exit=lambda code: done.set(), hold_main_thread=False)
    time.sleep(3.0)  # the processes import and connect
    go.set()
    time.sleep(reporter.check_s)  # every rank has checked once: the job runs
    t0 = time.time()
    reporter.tick(time.monotonic())
    done.wait(600)
    parts = [q.get(timeout=600) for _ in ps]
    for p in ps:
        p.join(10)
    seen = max(s for p in parts for s in p["seen"])
    return {"all_saw_abort_s": seen - t0, "report_s": stamps["report"] - t0,
            "all_read_report_s": max(p["read"] for p in parts) - t0, "report_chars": float(len(reporter.report or ""))}


# --- ps dispatch and the lighthouse quorum --------------------------------------------------------------
def dispatch(workers: int, batches_per_worker: int = 64) -> dict[str, float]:
    """ps task 0's ``Dispatcher`` with ``workers`` link threads (one per worker, as on ps task 0) for one pass."""
    from towers.strategies.parameter_server.dispatch import Dispatcher

    class Server:
        def __init__(self) -> None:
            self.cond = threading.Condition()
            self.links = [None] * workers
            self.dead: dict[int, str] = {}
            self.finished: set[int] = set()

        def active(self) -> set[int]:
            return {w for w in range(workers) if w not in self.dead}

        def wait(self, ready: Any, what: str, missing: Any) -> None:
            if not self.cond.wait_for(ready, timeout=600):
                raise TimeoutError(what)

    d = Dispatcher(Server())
    spec = {"num_examples": workers * batches_per_worker * 2, "global_batch_size": workers * 2,
            "drop_remainder": False, "start": 0, "epoch": 0, "num_replicas": workers}
    lat: list[float] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        step, mine = 0, []
        while True:
            t0 = time.perf_counter()
            a = d.next(w, {"key": "d1.1", "step": step, "spec": spec})
            mine.append(time.perf_counter() - t0)
            if a["kind"] == "stop":
                break
            step += len(a.get("units", [None]))
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat.sort()
    return {"workers": workers, "requests": len(lat), "requests_per_s": len(lat) / wall, "pass_s": wall,
            "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)]}


def quorum(groups: int, rounds: int = 3) -> dict[str, float]:
    """``groups`` replica groups ask torchft's lighthouse for a quorum at once, ``rounds`` times; seconds per round."""
    from torchft.coordination import LighthouseClient

    from towers.strategies.fault_tolerant import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=groups, peer_timeout_s=60.0)
    try:
        times = []
        for step in range(rounds):
            barrier = threading.Barrier(groups + 1)
            got: list[float] = []

            def ask(g: int, step: int = step, barrier: threading.Barrier = barrier, got: list[float] = got) -> None:
                client = LighthouseClient(lighthouse.address, connect_timeout=timedelta(seconds=30))
                barrier.wait()
                q = client.quorum(replica_id=f"group{g}", timeout=timedelta(seconds=120), address=f"a{g}",
                                  store_address=f"s{g}", step=step, world_size=1)
                got.append(len(q.participants))

            threads = [threading.Thread(target=ask, args=(g,)) for g in range(groups)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            times.append(time.perf_counter() - t0)
            if got != [groups] * groups:
                raise RuntimeError(f"quorum of {groups} groups: participants seen {sorted(set(got))}")
        return {"groups": groups, "quorum_s_median": statistics.median(times), "quorum_s_max": max(times)}
    finally:
        lighthouse.shutdown()


# --- start-up: the rendezvous -----------------------------------------------------------------------
def _announce_worker(port: int, prefix: str, members: range, hosts: int, out: Any) -> None:
    from towers.cluster.rendezvous import Member, announce

    store = CountingStore(_client(port, prefix))
    for i in members:  # what each member's own join writes before it waits (the real function)
        announce(store, index=i, me=Member("sim", "", 100_000 + i, f"host{i % hosts}"), describe=str)
    out.put(sum(store.counts.values()))


def rendezvous(port: int, world: int, procs: int, *, waiting_sample: int = 32, per_host: int = 8) -> dict[str, float]:
    """Start-up of ``world`` ranks: the chief and ``waiting_sample`` other members run the real ``join`` (threads);
    ``procs`` client processes announce all the other members with the real ``announce``, as fast as the store takes
    them. Reported: the store calls of the whole rendezvous, the time from the last arrival to the verdict seen by
    every waiting member, and the calls per second the waiting members make (measured on the sample, scaled to N)."""
    from towers.cluster.rendezvous import Member, join

    prefix = f"rdzv{world}"
    chief_store = CountingStore(_client(port, prefix))
    sample = list(range(1, 1 + waiting_sample))
    sample_stores = [CountingStore(_client(port, prefix)) for _ in sample]
    done: dict[int, float] = {}

    def member(i: int, store: Any, is_chief: bool) -> None:
        join(store, index=i, count=world, is_chief=is_chief, timeout_s=600, where="sim", describe=str,
             report=lambda line: None, me=Member("sim", "", 100_000 + i, f"host{i % (world // per_host)}"))
        done[i] = time.perf_counter()

    threads = [threading.Thread(target=member, args=(0, chief_store, True))]
    threads += [threading.Thread(target=member, args=(i, s, False)) for i, s in zip(sample, sample_stores)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    rest = list(range(1 + waiting_sample, world))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    chunks = [range(rest[0] + k, rest[-1] + 1, procs) for k in range(procs)] if rest else []
    ps = [ctx.Process(target=_announce_worker, args=(port, prefix, c, world // per_host, q)) for c in chunks]
    for p in ps:
        p.start()
    announced = sum(q.get(timeout=600) for _ in ps)
    last_arrival = time.perf_counter()
    for p in ps:
        p.join(30)
    for t in threads:
        t.join(600)
    waited = max(done.values()) - started
    sample_calls = sum(sum(s.counts.values()) for s in sample_stores)
    per_waiting_member = sample_calls / max(len(sample), 1)  # its announce, its host's arrivals, its polls
    # every member but the chief announces and waits as the sample did (the announcing processes' calls, ``announced``,
    # are the announce part alone of the members that did not wait here)
    total = sum(chief_store.counts.values()) + per_waiting_member * (world - 1)
    return {"ranks": world, "start_up_s": round(waited, 2),
            "verdict_after_last_arrival_s": round(max(done.values()) - last_arrival, 2),
            "chief_calls": sum(chief_store.counts.values()), "calls_per_waiting_member": round(per_waiting_member, 1),
            "announce_calls_per_member": round(announced / max(len(rest), 1), 1),
            "total_calls": round(total), "calls_per_member": round(total / world, 1)}


# --- the command ------------------------------------------------------------------------------------
def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--procs", type=int, default=4, help="client processes driving the simulated ranks")
    parser.add_argument("--seconds", type=float, default=120.0, help="job time simulated (counted: the second half)")
    parser.add_argument("--step-s", type=float, default=1.0, help="job time between two step boundaries")
    parser.add_argument("--legacy", action="store_true", help="the cadence before: beat + check every poll, "
                        "the notice read at every step")
    parser.add_argument("--no-stuck", action="store_true")
    parser.add_argument("--dispatch-workers", type=int, default=1024)
    parser.add_argument("--quorum-groups", type=int, default=256)
    parser.add_argument("--no-rendezvous", action="store_true", help="leave out the start-up rendezvous runs")
    args = parser.parse_args()

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    port = server.port
    cap = capacity(port, args.procs)
    print(json.dumps({"store_capacity_ops_s": round(cap)}), flush=True)
    if not args.no_rendezvous:
        for n in args.ranks:
            print(json.dumps({"rendezvous": rendezvous(port, n, args.procs)}), flush=True)
    for n in args.ranks:
        res = run_steady(port, n, args.procs, seconds=args.seconds, step_s=args.step_s, legacy=args.legacy,
                         notice_at_s=args.seconds * 0.75, prefix=f"steady{n}")
        per = per_rank_ops(res)
        total = sum(per.values()) * n
        steps = {s for s, _ in res["saved"].values()}
        agree_s = max(t for _, t in res["saved"].values()) - args.seconds * 0.75 if res["saved"] else float("nan")
        lat = res["lat"]
        row = {"ranks": n, "per_rank_ops_s": {k: round(v, 4) for k, v in per.items()},
               "towers_ops_s": round(total), "share_of_store": round(total / cap, 4),
               "op_p50_ms": round(1e3 * lat[len(lat) // 2], 3), "op_p99_ms": round(1e3 * lat[int(len(lat) * .99)], 3),
               "check_s": res["check_s"], "beat_s": res["beat_s"], "preemption_every_steps": res["every_steps"],
               "preemption_saved_ranks": len(res["saved"]), "preemption_steps": sorted(steps),
               "preemption_agreed_after_s": round(agree_s, 2), "sim_wall_s": round(res["wall_s"], 1)}
        print(json.dumps(row), flush=True)
        if not args.no_stuck and not args.legacy:
            print(json.dumps({"ranks": n, **{k: round(v, 2) for k, v in stuck_latency(port, n, args.procs).items()}}),
                  flush=True)
    if args.dispatch_workers:
        print(json.dumps({k: round(v, 3) for k, v in dispatch(args.dispatch_workers).items()}), flush=True)
    if args.quorum_groups:
        print(json.dumps({k: round(v, 3) for k, v in quorum(args.quorum_groups).items()}), flush=True)


if __name__ == "__main__":
    main()
