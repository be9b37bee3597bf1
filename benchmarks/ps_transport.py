"""Parameter-server transport: push+pull round trip over Gloo point-to-point vs torch.distributed.rpc.

One ps process and 1 or 2 workers on this host (loopback). Each worker sends a flat float32
gradient buffer to the ps and receives a flat parameter buffer of the same size back; the ps
answers each worker from its own thread. We time the worker's round trip (median of --repeats,
after --warmup), for 347k (seed CNN) and 10M parameters. For reference, a Gloo all-reduce of the
same bytes between the workers (no ps) is timed too, and the shipped towers transport
(``towers.strategies.parameter_server``) when ``--towers`` is given.

    python benchmarks/ps_transport.py --repeats 7
    python benchmarks/ps_transport.py --interleaved --sizes 10M --repeats 15   # step vs all-reduce, one job
    python benchmarks/ps_transport.py --interleaved --sizes 10M --transports shared,wire --passes 2
    python benchmarks/ps_transport.py --raw-chunks 1,4,10 --sizes 10M --repeats 7  # the wire alone, pipelined

Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import warnings
from typing import Any

SIZES = {"347k": 347_146, "10M": 10_000_000}


def _env_rank() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _pair(prefix: str, w: int, rank: int) -> Any:
    """The two-rank Gloo group of worker ``w`` and the ps task (the last rank), on loopback."""
    import datetime

    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=120)
    store = dist.distributed_c10d._get_default_store()
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/{w}", store), 0 if rank == w else 1, 2, opts)


def _alternate(step: Any, flat: Any, group: Any, repeats: int, warmup: int, block: int = 5) -> dict:
    """Alternate blocks of ``block`` calls of ``step`` and of all-reduces of ``flat`` among ``group``; return the
    medians of the block medians (ms) and the median of the per-round ratios."""
    import torch.distributed as dist

    steps, reduces, ratios = [], [], []
    for i in range(repeats + warmup):
        # A block of steps as a worker runs them (no barrier in between: the workers drift apart, as async
        # training lets them), then a block of all-reduces; the ratio of the two block medians.
        dist.barrier(group=group)
        step_ms = []
        for _ in range(block):
            t0 = time.perf_counter()
            step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
        dist.barrier(group=group)
        reduce_ms = []
        for _ in range(block):
            t0 = time.perf_counter()
            dist.all_reduce(flat, group=group)
            reduce_ms.append((time.perf_counter() - t0) * 1e3)
        if i >= warmup:
            steps.append(statistics.median(step_ms))
            reduces.append(statistics.median(reduce_ms))
            ratios.append(steps[-1] / reduces[-1])
    return {"step_ms": statistics.median(steps), "allreduce_ms": statistics.median(reduces),
            "ratio_median": statistics.median(ratios)}


def _gloo_p2p(numel: int, repeats: int, warmup: int) -> float | None:
    """Time push+pull over a dedicated 2-rank Gloo group per (worker, ps) pair; return the worker's median (ms)."""
    import torch
    import torch.distributed as dist

    rank, world = _env_rank()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    ps = world - 1
    workers = list(range(world - 1))

    n = repeats + warmup
    if rank == ps:
        groups = [_pair("bench", w, rank) for w in workers]
        params = torch.randn(numel)

        def serve(g) -> None:
            grad = torch.empty(numel)
            for _ in range(n):
                g.recv([grad], 0, 0).wait()
                params.add_(grad, alpha=-1e-6)
                g.send([params], 0, 0).wait()

        threads = [threading.Thread(target=serve, args=(g,)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result = None
    else:
        g = _pair("bench", rank, rank)
        grad, params = torch.randn(numel), torch.empty(numel)
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            g.send([grad], 1, 0).wait()
            g.recv([params], 1, 0).wait()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        result = statistics.median(times)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _rpc(numel: int, repeats: int, warmup: int) -> float | None:
    """Time push+pull as one rpc_sync call returning a tensor of the same size; return the worker's median (ms).

    The remote function is ``torch.add(grad, 1.0)``: a builtin, so the call pays no Python pickling of
    a user function; the bytes moved are those of a push and a pull.
    """
    import torch
    import torch.distributed.rpc as rpc

    rank, world = _env_rank()
    ps = world - 1
    warnings.filterwarnings("ignore")
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=120,
                                           init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    result = None
    if rank != ps:
        grad = torch.randn(numel)
        times = []
        for i in range(repeats + warmup):
            t0 = time.perf_counter()
            rpc.rpc_sync(f"r{ps}", torch.add, args=(grad, 1.0))
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        result = statistics.median(times)
    rpc.shutdown()
    return result


def _allreduce(numel: int, repeats: int, warmup: int) -> float:
    """Time a Gloo all-reduce of ``numel`` float32 between the processes; return rank 0's median (ms)."""
    import torch
    import torch.distributed as dist

    rank, world = _env_rank()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    t = torch.randn(numel)
    times = []
    for i in range(repeats + warmup):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    dist.destroy_process_group()
    return statistics.median(times)


def _flat_ps_model(numel: int, mode: str, rank: int, world: int, shared: bool = True) -> tuple[Any, Any]:
    """This rank's ParameterServerStrategy (1 ps task) and the prepared optimizer of a ``numel``-parameter linear
    model with random gradients; ``(None, None)`` on the ps task, once it has served."""
    import torch

    import towers
    from towers.cluster.info import ProcessInfo

    info = ProcessInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                       master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                       strategy="ps", num_ps=1)
    strategy = towers.ParameterServerStrategy(num_ps=1, mode=mode, info=info, exit_on_ps=False, shared_memory=shared)
    if strategy.is_ps:
        return None, None
    model = torch.nn.Linear(numel // 1000, 1000, bias=False)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-9))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return strategy, optimizer


def _towers(numel: int, repeats: int, warmup: int, mode: str) -> float | None:
    """Time ``optimizer.step()`` (push+pull) of the shipped ParameterServerStrategy on a flat model (ms)."""

    rank, world = _env_rank()
    strategy, optimizer = _flat_ps_model(numel, mode, rank, world)
    if strategy is None:
        return None
    times = []
    for i in range(repeats + warmup):
        t0 = time.perf_counter()
        optimizer.step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    strategy.shutdown()
    return statistics.median(times)


def _interleaved(numel: int, repeats: int, warmup: int, mode: str, shared: bool = True) -> dict | None:
    """In one job of W workers + 1 ps: alternate blocks of 5 ``optimizer.step()`` (push+pull of ``numel``
    parameters) and blocks of 5 Gloo all-reduces of the same bytes among the workers; return the medians of the
    block medians and the median of the per-round ratios."""
    import torch
    import torch.distributed as dist

    rank, world = _env_rank()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    workers = dist.new_group(list(range(world - 1)))  # every rank joins, the ps task too
    strategy, optimizer = _flat_ps_model(numel, mode, rank, world, shared)
    if strategy is None:
        return None
    result = _alternate(optimizer.step, torch.randn(numel), workers, repeats, warmup)
    strategy.shutdown()
    return result


def _raw_chunked(numel: int, chunks: int, repeats: int, warmup: int) -> dict | None:
    """The wire alone, pipelined: each worker posts its gradient in ``chunks`` pieces and the receives of the
    reply at once; the ps updates chunk k (``add_``) and sends it back while chunk k+1 arrives. Alternated in
    blocks of 5 with all-reduces of the same bytes, as ``_interleaved`` does; return the same medians."""
    import torch
    import torch.distributed as dist

    rank, world = _env_rank()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    workers_group = dist.new_group(list(range(world - 1)))
    ps, block = world - 1, 5

    bounds = [numel * k // chunks for k in range(chunks + 1)]
    ranges = list(zip(bounds, bounds[1:]))
    if rank == ps:
        groups = [_pair("chunked", w, rank) for w in range(world - 1)]
        params, lock = torch.randn(numel), threading.Lock()

        def serve(g: Any) -> None:
            grad = torch.empty(numel)
            for _ in range((repeats + warmup) * block):
                works, sends = [g.recv([grad[a:b]], 0, 0) for a, b in ranges], []
                for (a, b), work in zip(ranges, works):
                    work.wait()
                    with lock:
                        params[a:b].add_(grad[a:b], alpha=-1e-6)
                    sends.append(g.send([params[a:b]], 0, 0))
                for work in sends:
                    work.wait()

        threads = [threading.Thread(target=serve, args=(g,)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dist.barrier()
        dist.destroy_process_group()
        return None
    g = _pair("chunked", rank, rank)
    grad, params = torch.randn(numel), torch.empty(numel)

    def push_pull() -> None:
        works = [g.send([grad[a:b]], 1, 0) for a, b in ranges] + [g.recv([params[a:b]], 1, 0) for a, b in ranges]
        for work in works:
            work.wait()

    result = _alternate(push_pull, torch.randn(numel), workers_group, repeats, warmup, block)
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> None:
    """Run every measurement and print a markdown table."""
    import towers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--towers", action="store_true", help="also time the shipped towers transport")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--skip-rpc", action="store_true", help="leave torch.distributed.rpc out")
    parser.add_argument("--interleaved", action="store_true",
                        help="only: async optimizer.step() vs all-reduce of the same bytes, alternated in blocks of 5 "
                             "in one job of 2 workers + 1 ps (the ratio that noise from other processes affects least)")
    parser.add_argument("--transports", default="shared", metavar="T1,T2",
                        help="with --interleaved: 'shared' (the default: shared memory on one host) and/or 'wire' "
                             "(shared_memory=False), each its own job, alternated --passes times")
    parser.add_argument("--passes", type=int, default=1, help="with --interleaved: times each transport runs")
    parser.add_argument("--raw-chunks", default=None, metavar="C1,C2",
                        help="only: the wire alone (raw Gloo send/recv, ps add_ per chunk), pipelined in C chunks, "
                             "alternated with all-reduces as --interleaved does")
    args = parser.parse_args()
    if args.raw_chunks:
        print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}", flush=True)
        for label in args.sizes.split(","):
            for chunks in (int(c) for c in args.raw_chunks.split(",")):
                res = towers.spawn(_raw_chunked, 3, args=(SIZES[label], chunks, args.repeats, args.warmup),
                                   timeout_s=600, threads_per_process=1)
                for w, r in enumerate(res[:2]):
                    print(f"{label} {chunks} chunk(s) worker {w}: raw push+pull {r['step_ms']:.1f} ms, all-reduce "
                          f"{r['allreduce_ms']:.1f} ms, median ratio {r['ratio_median']:.2f}x", flush=True)
        print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}", flush=True)
        return
    if args.interleaved:
        print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}", flush=True)
        for label in args.sizes.split(","):
            for _ in range(args.passes):
                for transport in args.transports.split(","):
                    res = towers.spawn(_interleaved, 3, args=(SIZES[label], args.repeats, args.warmup, "async",
                                                              transport == "shared"),
                                       timeout_s=600, threads_per_process=1)
                    for w, r in enumerate(res[:2]):
                        print(f"{label} {transport} worker {w}: async step {r['step_ms']:.1f} ms, all-reduce "
                              f"{r['allreduce_ms']:.1f} ms, median ratio {r['ratio_median']:.2f}x", flush=True)
        print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}", flush=True)
        return
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for label in args.sizes.split(","):
        numel = SIZES[label]
        for workers in (int(w) for w in args.workers.split(",")):
            row = {"size": label, "workers": workers}
            raw = (("gloo_p2p", _gloo_p2p),) + ((("rpc", _rpc),) if not args.skip_rpc else ())
            for name, fn in raw:
                res = towers.spawn(fn, workers + 1, args=(numel, args.repeats, args.warmup), timeout_s=600,
                                   threads_per_process=1)
                row[name] = statistics.median(r for r in res if r is not None)
            if args.towers:
                for mode in ("async", "sync"):
                    res = towers.spawn(_towers, workers + 1, args=(numel, args.repeats, args.warmup, mode),
                                       timeout_s=600, threads_per_process=1)
                    row[f"towers_{mode}"] = statistics.median(r for r in res if r is not None)
            if workers == 2:
                res = towers.spawn(_allreduce, 2, args=(numel, args.repeats, args.warmup), timeout_s=600,
                                   threads_per_process=1)
                row["allreduce"] = res[0]
            if "allreduce" in row and "towers_async" in row:
                row["async_over_allreduce"] = row["towers_async"] / row["allreduce"]
            rows.append(row)
            print(row, flush=True)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}", flush=True)
    cols = ["gloo_p2p", "rpc"] + (["towers_async", "towers_sync"] if args.towers else []) + ["allreduce"]
    print("\n| params | workers | " + " | ".join(f"{c} (ms)" for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['size']} | {r['workers']} | " + " | ".join(
            f"{r[c]:.1f}" if c in r else "-" for c in cols) + " |")


if __name__ == "__main__":
    main()
