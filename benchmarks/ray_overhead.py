"""The README's workload under Ray Train against ``towers launch``, on this machine, in interleaved rounds.

Each round runs the same job twice, alternating which goes first: ``towers launch --nproc-per-node N --strategy
mirrored`` and a ``TorchTrainer`` of N workers (``towers.ray.train_loop``, ``MirroredStrategy()``) on one local Ray
cluster started once. The job trains the seed CNN on the bundled digits (Adam, 64 examples per replica, shuffled,
S steps). Reported, medians over the rounds, Ray / launch (goal: >= 0.975, Ray Train's own overhead claim):

- steady state: examples/s over the steps after the first 5, timed inside the job by the chief;
- the whole job: wall time from the call (``towers launch`` / ``trainer.fit()``) to its end, start-up included;
  Ray's cluster start-up (``ray.init``) is reported once, beside it.

Both give each process one torch thread (``towers launch``: cores // N on 2 cores; Ray: one CPU per worker).

    python benchmarks/ray_overhead.py                        # 2 workers, 5 rounds
    python benchmarks/ray_overhead.py --rounds 7 --steps 120 --json-out ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP_STEPS = 5


def job(steps: int, out: str) -> None:
    """Inside a job (either launcher): train ``steps`` steps; the chief writes its steady examples/s to ``out``."""
    import torch
    import torch.nn.functional as F

    import towers
    from towers.datasets import load_digits
    from towers.models import SeedCNN

    strategy = towers.MirroredStrategy()
    train_set, _ = load_digits()
    torch.manual_seed(0)
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    global_batch = 64 * strategy.num_replicas_in_sync
    batches = strategy.distribute_dataset(train_set, global_batch_size=global_batch, shuffle=True, seed=0,
                                          drop_remainder=True)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    done, start = 0, 0.0
    while done < steps:
        for x, y in batches:
            strategy.reduce("sum", strategy.run(step, args=(x, y))).item()  # every replica waits for the step
            done += 1
            if done == WARMUP_STEPS:
                start = time.perf_counter()
            if done == steps:
                break
    elapsed = time.perf_counter() - start
    if strategy.is_chief:
        Path(out).write_text(json.dumps({"examples_per_s": (steps - WARMUP_STEPS) * global_batch / elapsed}))


def ray_entry(config: dict) -> None:
    """``train_loop_per_worker`` of the Ray runs."""
    job(config["steps"], config["out"])


def _launch(workers: int, steps: int, out: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "towers.cli", "launch", "--nproc-per-node", str(workers), "--strategy",
                    "mirrored", __file__, "--job", out, "--steps", str(steps)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _ray(workers: int, steps: int, out: str, storage: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import towers.ray

    start = time.perf_counter()
    TorchTrainer(towers.ray.train_loop(ray_entry), train_loop_config={"steps": steps, "out": out},
                 scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                 run_config=RunConfig(storage_path=storage)).fit()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--json-out")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # inside a towers launch job: the chief's output file
    args = parser.parse_args()
    if args.job:
        job(args.steps, args.job)
        return

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a benchmark's cluster reports nothing anywhere
    temp = tempfile.mkdtemp(prefix="towers-ray-bench-")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    start = time.perf_counter()
    ray.init(num_cpus=2 * args.workers, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}})
    ray_start_s = time.perf_counter() - start
    rows: dict[str, list[float]] = {"launch": [], "ray": [], "launch_wall": [], "ray_wall": []}
    try:
        for r in range(args.rounds):
            for engine in (("launch", "ray") if r % 2 == 0 else ("ray", "launch")):
                out = os.path.join(temp, f"{engine}-{r}.json")
                wall = (_launch(args.workers, args.steps, out) if engine == "launch"
                        else _ray(args.workers, args.steps, out, os.path.join(temp, "storage")))
                rows[engine].append(json.loads(Path(out).read_text())["examples_per_s"])
                rows[f"{engine}_wall"].append(wall)
                print(f"round {r + 1} {engine}: {rows[engine][-1]:,.0f} examples/s, job {wall:.1f} s", flush=True)
    finally:
        ray.shutdown()
    ratios = [a / b for a, b in zip(rows["ray"], rows["launch"])]
    summary = {
        "workers": args.workers, "rounds": args.rounds, "steps": args.steps, "ray_init_s": ray_start_s,
        "examples_per_s": {k: statistics.median(rows[k]) for k in ("launch", "ray")},
        "steady_ratio_median": statistics.median(ratios), "steady_ratios": ratios,
        "job_s": {k: statistics.median(rows[f"{k}_wall"]) for k in ("launch", "ray")},
    }
    print(f"steady examples/s, median of {args.rounds}: towers launch {summary['examples_per_s']['launch']:,.0f}, "
          f"Ray {summary['examples_per_s']['ray']:,.0f}; Ray / launch {summary['steady_ratio_median']:.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    print(f"whole job, median: towers launch {summary['job_s']['launch']:.1f} s, Ray {summary['job_s']['ray']:.1f} s "
          f"(Ray's cluster start, once: {ray_start_s:.1f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
