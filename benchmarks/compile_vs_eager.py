"""Compiled against eager: ``strategy.prepare(model, optimizer, compile=...)`` on the seed CNN, same processes.

Per-replica batch 64, Adam, one torch thread per process, synthetic [B, 1, 28, 28] images. Each
rank prepares the same model twice (eager, and compiled with the chosen backend; the strategy
wraps first and compiles the wrapped module), pays the compilation in an untimed warm-up, then
times S steps of each, alternating which goes first, R repeats. Reported: ms/step of each and the
compiled/eager speed-up, median and range, at 1 replica (OneDeviceStrategy) and 2 (MirroredStrategy).

    python benchmarks/compile_vs_eager.py                        # inductor (needs a C++ compiler), 1 and 2 replicas
    python benchmarks/compile_vs_eager.py --backend aot_eager --replicas 2 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import towers
from towers.datasets import synthetic_images
from towers.models import SeedCNN


def _measure(steps: int, repeats: int, batch_size: int, backend: str) -> dict:
    torch.set_num_threads(1)
    strategy = towers.strategy_from_env()
    n = strategy.num_replicas_in_sync
    data = synthetic_images(batch_size * n * steps, seed=0)
    engines = {}
    for name, compile in (("eager", False), ("compiled", {"backend": backend})):
        with strategy.scope():
            torch.manual_seed(0)
            net = SeedCNN()
        model, opt = strategy.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3), compile=compile)

        def step(x, y, model=model, opt=opt):
            strategy.backward(towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")))
            opt.step()
            opt.zero_grad()

        engines[name] = step
    batches = list(strategy.distribute_dataset(data, batch_size * n, shuffle=False))
    compile_s = {}
    for name, step in engines.items():  # warm-up; the first compiled steps compile
        start = time.perf_counter()
        for x, y in batches[:3]:
            strategy.run(step, args=(x, y))
        compile_s[name] = time.perf_counter() - start
    rows = []
    for r in range(repeats):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        row = {}
        for name in order:
            strategy.barrier()
            start = time.perf_counter()
            for x, y in batches:
                strategy.run(engines[name], args=(x, y))
            strategy.barrier()
            row[name] = 1000.0 * (time.perf_counter() - start) / len(batches)
        rows.append(row)
    return {"replicas": n, "rows": rows, "warmup_s": compile_s}


def main(argv: list[str] | None = None) -> int:
    """Run at each replica count and print ms/step of both engines and the speed-up."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,2", help="replica counts (default: 1,2)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat and engine (default: 30)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default: 5)")
    p.add_argument("--batch-size", type=int, default=64, help="per-replica batch (default: 64)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    args = p.parse_args(argv)
    for n in (int(v) for v in args.replicas.split(",")):
        result = towers.spawn(_measure, n, args=(args.steps, args.repeats, args.batch_size, args.backend),
                              timeout_s=1800, threads_per_process=1,
                              env={"TOWERS_STRATEGY": "one_device" if n == 1 else "mirrored"})[0]
        rows = result["rows"]
        ratios = [r["eager"] / r["compiled"] for r in rows]
        eager, compiled = statistics.median(r["eager"] for r in rows), statistics.median(r["compiled"] for r in rows)
        print(f"{n} replica(s), {args.backend}: eager {eager:.2f} ms/step, compiled {compiled:.2f} ms/step, "
              f"speed-up {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, {len(rows)} "
              f"repeats); warm-up incl. compilation {result['warmup_s']['compiled']:.1f} s "
              f"(eager {result['warmup_s']['eager']:.1f} s)", flush=True)
    print(f"1-minute load average: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
