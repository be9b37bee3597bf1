"""The cost of the step identity in Mirrored's gradient all-reduce: seed CNN DDP steps with and without it.

Two DDP copies of the seed CNN share one 2-process job and its process group; both get towers' SUM
comm hook, one with the step identity folded into its first bucket (``StepCheck``: what Mirrored
registers), one without. Each repeat times S steps of each (forward, backward, SGD step; per-replica
batch 64, one torch thread per process) in alternating blocks of 5 steps, in wall and CPU time
(every thread of the process); the report is the median over repeats of ms/step and of the
per-repeat ratio with/without.

    python benchmarks/step_identity.py                       # 2 replicas, 7 repeats x 30 steps (~1 min on 2 cores)
    python benchmarks/step_identity.py --compression bf16 --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _job(steps: int, warmup: int, repeats: int, batch_size: int, compression: str, block: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import towers
    from towers.data import BatchInfo
    from towers.models import SeedCNN
    from towers.strategies._comm_hooks import register_sum_hook
    from towers.strategies._step_check import StepCheck
    from towers.strategies._steps import StepTracker

    strategy = towers.MirroredStrategy()  # joins the process group
    rank, n = strategy.replica_id, strategy.num_replicas_in_sync
    tracker = StepTracker()
    engines = {}
    for name, check in (("without", None), ("with", StepCheck(tracker, rank=rank, num_replicas=n))):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(SeedCNN(), gradient_as_bucket_view=True)
        register_sum_hook(ddp, compression, n, check=check)
        engines[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    counter = [0]

    def step(name: str) -> None:
        ddp, opt = engines[name]
        counter[0] += 1
        tracker.begin_run(BatchInfo(counter[0] % 1000, 1000, batch_size * n, batch_size, 0, batch_size * n, 1, True,
                                    epoch=counter[0] // 1000))
        loss = F.cross_entropy(ddp(x), y, reduction="sum") / (batch_size * n)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for name in engines:
        for _ in range(warmup):
            step(name)
    ms: dict[str, list[float]] = {"with": [], "without": []}
    cpu_ms: dict[str, list[float]] = {"with": [], "without": []}
    for r in range(repeats):
        wall, cpu = {"with": 0.0, "without": 0.0}, {"with": 0.0, "without": 0.0}
        for b in range(steps // block):  # blocks of `block` steps, A B B A ...: drift in the host's load cancels
            for name in (("with", "without") if (r + b) % 2 == 0 else ("without", "with")):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(block):
                    step(name)
                wall[name] += time.perf_counter() - start
                cpu[name] += time.process_time() - start_cpu  # every thread of this process (Gloo's too)
        for name in ms:
            ms[name].append(wall[name] / (steps // block * block) * 1e3)
            cpu_ms[name].append(cpu[name] / (steps // block * block) * 1e3)
    return {"rank": rank, "ms": ms, "cpu_ms": cpu_ms, "params": sum(p.numel() for p in SeedCNN().parameters())}


def main(argv: list[str] | None = None) -> int:
    """Run the job, print ms/step with and without the step identity; return 0 (a benchmark reports, never fails)."""
    import towers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per engine and repeat (default: 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each timed run (default: 3)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats, >= 3 (default: 7)")
    p.add_argument("--batch-size", type=int, default=64, help="per-replica batch (default: 64)")
    p.add_argument("--compression", default="none", choices=("none", "fp16", "bf16"),
                   help="gradient all-reduce compression (default: none)")
    p.add_argument("--replicas", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--block", type=int, default=5, help="steps per alternation inside a repeat (default: 5)")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error(f"--repeats must be >= 3 (a median of interleaved repeats). Received: {args.repeats}.")
    results = towers.spawn(_job, args.replicas, args=(args.steps, args.warmup, args.repeats, args.batch_size,
                                                      args.compression, args.block),
                           threads_per_process=1, timeout_s=60 + 2 * args.repeats * args.steps)
    print(f"seed CNN ({results[0]['params']:,} parameters), {args.replicas} replicas, per-replica batch "
          f"{args.batch_size}, compression={args.compression}, {args.repeats} repeats x {args.steps} steps")
    print("medians over repeats; ratio: median of the per-repeat with/without")
    print(f"{'rank':>4} {'clock':>5} {'without ms/step':>16} {'with ms/step':>13} {'with/without':>13}  per repeat")
    for result in results:
        for clock, key in (("wall", "ms"), ("cpu", "cpu_ms")):
            ms = result[key]
            ratios = [a / b for a, b in zip(ms["with"], ms["without"])]
            print(f"{result['rank']:>4} {clock:>5} {statistics.median(ms['without']):>16.2f} "
                  f"{statistics.median(ms['with']):>13.2f} {statistics.median(ratios):>13.3f}  "
                  f"{', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"1-minute load average after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
