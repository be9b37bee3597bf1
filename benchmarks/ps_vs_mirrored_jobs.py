"""Parameter servers against Mirrored as a user chooses between them: separate jobs, interleaved rounds.

Each round launches, one after the other (the order rotates each round), the same training script
under ``towers launch``:

- ``mirrored``: ``--nproc-per-node 2 --strategy mirrored`` (2 replicas);
- ``ps_async``: ``--nproc-per-node 3 --strategy ps --num-ps 1`` (2 workers + 1 ps task), async;
- ``ps_async_overlap``: the same with ``--strategy-option overlap=true`` (a push's reply is read
  during the next step: one more step of staleness);
- ``ps_sync``: the same with ``--strategy-option mode=sync``;
- ``ps_async_wire``, ``ps_sync_wire``: ``ps_async`` and ``ps_sync`` with
  ``--strategy-option shared_memory=false`` (the dense bytes on the wire, as between hosts).

The script: the seed CNN on synthetic [64, 1, 28, 28] batches per worker, the custom loop
(``strategy.run``, ``compute_average_loss``), ``--optimizer adam|sgd``; the chief times the steps
after the first 5. Reported: examples/s of each, and each PS variant over Mirrored (median of the
per-round ratios, with their range). On a 2-core host the ps task shares the cores with the two
workers, as TensorFlow's does in the comparison this answers.

    python benchmarks/ps_vs_mirrored_jobs.py                          # adam, 5 rounds (~4 min)
    python benchmarks/ps_vs_mirrored_jobs.py --optimizer sgd --rounds 7 --json-out ps_jobs.json
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

WARMUP_STEPS = 5
SETUPS = {
    "mirrored": ["--nproc-per-node", "2", "--strategy", "mirrored"],
    "ps_async": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1"],
    "ps_async_overlap": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1",
                         "--strategy-option", "overlap=true"],
    "ps_sync": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=sync"],
    "ps_async_wire": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1",
                      "--strategy-option", "shared_memory=false"],
    "ps_sync_wire": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=sync",
                     "--strategy-option", "shared_memory=false"],
}
#: what runs unless --setups says otherwise
DEFAULT_SETUPS = ("mirrored", "ps_async", "ps_async_wire", "ps_sync")


def _job(steps: int, batch_size: int, optimizer_name: str, out: str) -> None:
    """Inside the launched job: ``steps`` steps of the custom loop; the chief writes its timings to ``out``."""
    import torch
    import torch.nn.functional as F

    import towers
    from towers.datasets import synthetic_images
    from towers.models import SeedCNN

    strategy = towers.strategy_from_env()
    if getattr(strategy, "is_ps", False):
        return  # a ps task serves until the workers are done (and exits)
    n = strategy.num_replicas_in_sync
    data = synthetic_images(batch_size * n * steps, seed=0)
    with strategy.scope():
        torch.manual_seed(0)
        net = SeedCNN()
        optimizer = (torch.optim.Adam(net.parameters(), lr=1e-3) if optimizer_name == "adam"
                     else torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    model, opt = strategy.prepare(net, optimizer)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    times = []
    for x, y in strategy.distribute_dataset(data, batch_size * n, shuffle=False):
        strategy.run(step, args=(x, y))
        times.append(time.perf_counter())
    if strategy.is_chief:
        steady = times[WARMUP_STEPS:]
        ms = 1000.0 * (steady[-1] - steady[0]) / (len(steady) - 1)
        with open(out, "w") as f:
            json.dump({"steady_ms": ms, "examples_per_s": 1000.0 * batch_size * n / ms, "steps": len(times)}, f)
    strategy.shutdown()


def _launch(setup: str, args: argparse.Namespace, out: str) -> dict:
    command = [sys.executable, "-m", "towers", "launch", *SETUPS[setup], os.path.abspath(__file__), "--job",
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--optimizer", args.optimizer,
               "--out", out]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the {setup} job failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """Interleave the setups for ``--rounds`` rounds; print each round and the median ratios to Mirrored."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--steps", type=int, default=80, help="steps per job (default: 80)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--batch-size", type=int, default=64, help="per-worker batch (default: 64)")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--json-out", default=None, help="also write every round's results here")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        _job(args.steps, args.batch_size, args.optimizer, args.out)
        return 0
    setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or "mirrored" not in setups:
        p.error(f"--setups must name setups of {sorted(SETUPS)}, mirrored included. Received: {args.setups!r}.")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = setups[r % len(setups):] + setups[:r % len(setups)]
            result = {s: _launch(s, args, os.path.join(tmp, f"{s}-{r}.json")) for s in order}
            rounds.append(result)
            print(f"round {r + 1}: " + ", ".join(f"{s} {result[s]['examples_per_s']:,.0f}" for s in setups)
                  + " examples/s", flush=True)
    for s in setups:
        eps = statistics.median(r[s]["examples_per_s"] for r in rounds)
        line = f"{s:18s} {eps:8,.0f} examples/s"
        if s != "mirrored":
            ratios = [r[s]["examples_per_s"] / r["mirrored"]["examples_per_s"] for r in rounds]
            line += f"   / mirrored {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
        print(line)
    print(f"optimizer {args.optimizer}, {args.rounds} rounds; 1-minute load average {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rounds, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
