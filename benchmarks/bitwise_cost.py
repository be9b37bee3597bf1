"""What ``bitwise=True`` costs: step time of the seed CNN on the digits with and without it, at 2 and 4 replicas.

One ``towers.spawn`` job per (replicas, mode), the modes interleaved and each pair repeated; each job times its
steps after a warm-up and reports the median step. Both modes train the same global batch (48) with Adam;
bitwise cuts it into micro-batches of ``--micro-batch`` examples. The bytes each replica sends per step are
counted from the model's size: DDP's ring all-reduce sends ``2 (N-1)/N`` gradients; the tree sends this
replica's subtrees (padded to the same count on every replica) to every other replica in one all-gather.

    python benchmarks/bitwise_cost.py                           # 2 and 4 replicas, 3 repeats
    python benchmarks/bitwise_cost.py --replicas 2 --repeats 5 --micro-batch 12

Results go in BENCHMARKS.md ("Bit for bit: what it costs").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import towers  # noqa: E402
from bitwise_job import classifier_step  # noqa: E402
from towers.datasets import load_digits  # noqa: E402
from towers.models import SeedCNN  # noqa: E402

GLOBAL_BATCH = 48


def job(bitwise: bool, micro_batch: int, steps: int, warmup: int) -> float:
    """Median seconds per step of this process's loop."""
    strategy = towers.MirroredStrategy(bitwise=bitwise, micro_batch_size=micro_batch if bitwise else None)
    torch.manual_seed(0)
    train_set, _ = load_digits()
    net = SeedCNN()
    model, optimizer = strategy.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))

    step = classifier_step(strategy, model, optimizer)  # the bit-for-bit tests' step
    times: list[float] = []
    batches = strategy.distribute_dataset(train_set, GLOBAL_BATCH, shuffle=True, drop_remainder=True)
    while len(times) < steps + warmup:
        for x, y in batches:
            start = time.perf_counter()
            strategy.reduce("sum", strategy.run(step, args=(x, y))).item()
            times.append(time.perf_counter() - start)
            if len(times) == steps + warmup:
                break
    strategy.shutdown()
    return statistics.median(times[warmup:])


def wire_bytes(replicas: int, micro_batch: int) -> dict[str, float]:
    """Bytes one replica sends per step: DDP's ring all-reduce vs the tree's all-gather of padded subtrees."""
    n = sum(p.numel() for p in SeedCNN().parameters()) * 4
    from towers.strategies._bitwise import dyadic_nodes

    per = GLOBAL_BATCH // micro_batch // replicas
    width = max(len(dyadic_nodes(r * per, (r + 1) * per)) for r in range(replicas))
    return {"ddp": 2 * (replicas - 1) / replicas * n, "bitwise": (replicas - 1) * width * n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"seed CNN, global batch {GLOBAL_BATCH}, micro_batch_size={args.micro_batch}, Adam; median step (s) of "
          f"{args.steps} after {args.warmup}, median of {args.repeats} interleaved repeats")
    for n in args.replicas:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for bitwise in (False, True):  # interleaved: a slow moment of the machine hits both
                per_rank = towers.spawn(job, n, args=(bitwise, args.micro_batch, args.steps, args.warmup),
                                        timeout_s=600, threads_per_process=1)
                runs[bitwise].append(max(per_rank))
        plain, exact = statistics.median(runs[False]), statistics.median(runs[True])
        wire = wire_bytes(n, args.micro_batch)
        print(f"{n} replicas: DDP {plain * 1e3:.1f} ms, bitwise {exact * 1e3:.1f} ms, ratio {exact / plain:.2f}x; "
              f"bytes sent per replica per step: DDP {wire['ddp'] / 2**20:.2f} MiB, bitwise "
              f"{wire['bitwise'] / 2**20:.2f} MiB ({wire['bitwise'] / wire['ddp']:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
