"""Why a 1-replica baseline measured inside an N-process job differs from a standalone process.

``towers bench --replicas 1,2`` times its 1-replica baselines on rank 0 of the 2-process job
while rank 1 waits at a barrier; a standalone run (``--replicas 1``) times one process alone.
This script runs both set-ups alternately, several times, in one invocation, and prints for each
the examples/s (wall) and the CPU ms/step of the same plain-torch 1-replica workload, so a
difference in CPU time (work done) can be told from a difference in wall time (waiting for a core).

    python benchmarks/one_replica_baseline.py                 # 4 rounds of both set-ups (~3 min)
    python benchmarks/one_replica_baseline.py --rounds 6 --json-out baseline.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from towers.bench.config import BenchConfig
from towers.bench.report import RAW
from towers.bench.runner import run_benchmark


def _row(replicas: tuple[int, ...], steps: int, repeats: int) -> dict:
    config = BenchConfig(replicas=replicas, strategies=("mirrored",), steps=steps, warmup=5, repeats=repeats,
                         threads=1)
    report = run_benchmark(config)
    m = next(m for m in report.measurements if m.strategy == RAW and m.replicas == 1)
    return {"examples_per_s": statistics.median(m.examples_per_s), "cpu_ms": statistics.median(m.cpu_ms_per_step)}


def main(argv: list[str] | None = None) -> int:
    """Alternate the two set-ups ``--rounds`` times; print each round and the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="rounds of both set-ups (default: 4)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat (default: 30)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per job (default: 3)")
    p.add_argument("--json-out", default=None, help="also write the rounds here")
    args = p.parse_args(argv)
    setups = {"standalone (--replicas 1)": (1,), "inside a 2-process job (--replicas 1,2)": (1, 2)}
    rounds: dict[str, list[dict]] = {name: [] for name in setups}
    for r in range(args.rounds):
        order = list(setups) if r % 2 == 0 else list(setups)[::-1]
        for name in order:
            row = _row(setups[name], args.steps, args.repeats)
            rounds[name].append({**row, "load": os.getloadavg()[0]})
            print(f"round {r + 1}: {name}: {row['examples_per_s']:,.0f} examples/s, {row['cpu_ms']:.1f} CPU ms/step "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    for name, rows in rounds.items():
        eps = [row["examples_per_s"] for row in rows]
        cpu = [row["cpu_ms"] for row in rows]
        print(f"{name}: median {statistics.median(eps):,.0f} examples/s (range {min(eps):,.0f}-{max(eps):,.0f}), "
              f"{statistics.median(cpu):.1f} CPU ms/step")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rounds, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
