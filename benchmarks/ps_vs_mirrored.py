"""Parameter servers (async, sync) vs Mirrored (DDP all-reduce): training throughput of the seed CNN.

One job of 3 processes: ranks 0-1 are the workers, rank 2 the ps task. Each repeat runs, in the
same processes and interleaved, ``--steps`` timed steps (after ``--warmup``) of:

* ``ps_async`` / ``ps_sync``: ``ParameterServerStrategy(mode=...)``, the user's loop unchanged;
* ``mirrored``: DDP over a 2-rank group of the workers, which is what MirroredStrategy runs (the
  ps process sits idle in a barrier meanwhile).

Seed CNN, batch 64 per worker (global 128), synthetic 28x28 inputs, SGD, 1 thread per process.
Throughput = global examples per second over the timed steps, measured on worker 0 between
barriers; the table shows the median over ``--repeats``.

    python benchmarks/ps_vs_mirrored.py --repeats 5

Note: 3 processes on a 2-core machine oversubscribe the CPU (the ps competes with the workers).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

MODES = ("ps_async", "ps_sync", "mirrored")


def _batches(rank: int, n: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(n, 64, 1, 28, 28, generator=g), torch.randint(0, 10, (n, 64), generator=g)
    return x, y


def _loop(model, optimizer, x, y, steps: int, warmup: int, barrier) -> float:
    import torch.nn.functional as F

    for i in range(warmup + steps):
        if i == warmup:
            barrier()
            start = time.perf_counter()
        loss = F.cross_entropy(model(x[i % len(x)]), y[i % len(y)], reduction="sum") / 128
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    barrier()
    return time.perf_counter() - start


def _job(repeats: int, steps: int, warmup: int) -> dict | None:
    import torch
    import torch.distributed as dist

    import towers
    from towers import cluster
    from towers.models import SeedCNN

    info = cluster.from_env()
    rank = info.rank
    results: dict[str, list[float]] = {m: [] for m in MODES}
    x, y = _batches(rank, 8)
    workers = None
    for _ in range(repeats):
        for mode in MODES:
            if mode == "mirrored":
                if workers is None:
                    workers = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120))
                if rank < 2:
                    torch.manual_seed(0)
                    model = torch.nn.parallel.DistributedDataParallel(SeedCNN(), process_group=workers)
                    opt = torch.optim.SGD(model.parameters(), lr=0.01)
                    seconds = _loop(model, opt, x, y, steps, warmup, lambda: dist.barrier(group=workers))
                    results[mode].append(2 * 64 * steps / seconds)
                dist.barrier()  # the ps rank waits here while the workers train
                continue
            strategy = towers.ParameterServerStrategy(mode=mode[3:], info=info, exit_on_ps=False, timeout_s=120)
            if strategy.is_ps:
                continue
            torch.manual_seed(0)
            net = SeedCNN()
            model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
            seconds = _loop(model, opt, x, y, steps, warmup, strategy.barrier)
            results[mode].append(2 * 64 * steps / seconds)
            strategy.shutdown()
    return results if rank == 0 else None


def main() -> None:
    """Run the interleaved repeats and print a markdown table."""
    import towers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    results = towers.spawn(_job, 3, args=(args.repeats, args.steps, args.warmup), timeout_s=1800,
                           threads_per_process=1, env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})[0]
    base = statistics.median(results["mirrored"])
    print(f"cores: {len(os.sched_getaffinity(0))}, processes: 3 (2 workers + 1 ps), batch 64/worker, "
          f"{args.steps} steps x {args.repeats} repeats")
    print("\n| mode | examples/s (median) | all repeats | vs mirrored |")
    print("|---|---|---|---|")
    for mode in MODES:
        values = results[mode]
        print(f"| {mode} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} | "
              f"{statistics.median(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
