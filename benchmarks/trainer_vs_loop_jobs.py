"""Trainer.fit against the custom loop as a user compares them: two separate jobs, interleaved rounds.

Each round launches ``towers launch --nproc-per-node N --strategy mirrored`` twice, once per
engine, alternating which goes first. Both jobs train the seed CNN (Adam, per-replica batch 64,
synthetic [B, 1, 28, 28] images, one epoch of S steps, shuffled) and track loss and accuracy: the
Trainer with ``metrics=["accuracy"]`` and its progress bar (to /dev/null), the loop as TensorFlow's
custom-loop tutorial writes it (``strategy.run`` per step, ``compute_average_loss``, Keras-style
``Mean`` and ``SparseCategoricalAccuracy`` metrics whose ``result()`` is read at the end).
Reported, each as the Trainer's examples/s over the loop's (>= 0.95 is the goal), median over
the rounds:

- steady state: the steps after the first 5 (step ends timed inside the job);
- the whole epoch: from the call (``fit(...)`` / the loop's first batch) to its last step, set-up
  and the first steps included;
- the whole job: the launcher's wall time, start-up and process groups included.

    python benchmarks/trainer_vs_loop_jobs.py                         # 2 replicas, 5 rounds (~3 min)
    python benchmarks/trainer_vs_loop_jobs.py --rounds 7 --steps 150 --json-out jobs.json
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


def _job(engine: str, steps: int, batch_size: int, out: str) -> None:
    """Inside the launched job: train one epoch with ``engine``; the chief writes its timings to ``out``."""
    import torch
    import torch.nn.functional as F

    import towers
    from towers.datasets import synthetic_images
    from towers.metrics import Mean, SparseCategoricalAccuracy
    from towers.models import SeedCNN

    strategy = towers.strategy_from_env()
    n = strategy.num_replicas_in_sync
    data = synthetic_images(batch_size * n * steps, seed=0)
    with strategy.scope():
        torch.manual_seed(0)
        net = SeedCNN()
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    times: list[float] = []
    start = time.perf_counter()
    if engine == "trainer":

        class StepClock(towers.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter())

        trainer = towers.Trainer(net, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy)
        with open(os.devnull, "w") as devnull:
            history = trainer.fit(data, epochs=1, global_batch_size=batch_size * n,
                                  callbacks=[towers.callbacks.ProgressBar(stream=devnull), StepClock()])
        final = {"loss": history.history["loss"][-1], "accuracy": history.history["accuracy"][-1]}
    else:
        model, opt = strategy.prepare(net, optimizer)
        train_loss, train_accuracy = Mean("loss"), SparseCategoricalAccuracy("accuracy")

        def step(x, y):
            logits = model(x)
            per_example = F.cross_entropy(logits, y, reduction="none")
            loss = towers.compute_average_loss(per_example)
            loss.backward()
            opt.step()
            opt.zero_grad()
            train_loss.update(per_example)
            train_accuracy.update(logits, y)

        for x, y in strategy.distribute_dataset(data, batch_size * n, shuffle=True, seed=0):
            strategy.run(step, args=(x, y))
            times.append(time.perf_counter())
        final = {"loss": train_loss.result(), "accuracy": train_accuracy.result()}
    if strategy.is_chief:
        steady = times[WARMUP_STEPS:]
        result = {"engine": engine, "steps": len(times), "examples_per_step": batch_size * n,
                  "steady_ms": 1000.0 * (steady[-1] - steady[0]) / (len(steady) - 1),
                  "epoch_s": times[-1] - start, **final}
        with open(out, "w") as f:
            json.dump(result, f)
    strategy.shutdown()


def _launch(engine: str, args: argparse.Namespace, out: str) -> dict:
    """Run one job as a user would; return the chief's timings plus the launcher's wall time."""
    command = [sys.executable, "-m", "towers", "launch", "--nproc-per-node", str(args.replicas), "--strategy",
               "mirrored" if args.replicas > 1 else "one_device", os.path.abspath(__file__), "--job", engine,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--out", out]
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the {engine} job failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    result["job_s"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    """Interleave the two jobs for ``--rounds`` rounds; print each round and the median ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2, help="processes per job (default: 2)")
    p.add_argument("--steps", type=int, default=120, help="steps in each job's epoch (default: 120)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--batch-size", type=int, default=64, help="per-replica batch (default: 64)")
    p.add_argument("--json-out", default=None, help="also write every round's results here")
    p.add_argument("--job", choices=("trainer", "loop"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job is not None:
        _job(args.job, args.steps, args.batch_size, args.out)
        return 0
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("loop", "trainer") if r % 2 == 0 else ("trainer", "loop")
            results = {engine: _launch(engine, args, os.path.join(tmp, f"{engine}-{r}.json")) for engine in order}
            loop, trainer = results["loop"], results["trainer"]
            ratios = {"steady": loop["steady_ms"] / trainer["steady_ms"], "epoch": loop["epoch_s"] / trainer["epoch_s"],
                      "job": loop["job_s"] / trainer["job_s"]}
            rounds.append({"loop": loop, "trainer": trainer, "ratios": ratios})
            print(f"round {r + 1}: steady {loop['steady_ms']:.2f} / {trainer['steady_ms']:.2f} ms per step (loop / "
                  f"Trainer), epoch {loop['epoch_s']:.2f} / {trainer['epoch_s']:.2f} s, job {loop['job_s']:.1f} / "
                  f"{trainer['job_s']:.1f} s", flush=True)
    eps = args.batch_size * args.replicas
    for name in ("steady", "epoch", "job"):
        values = [r["ratios"][name] for r in rounds]
        print(f"Trainer / loop examples/s, {name}: {statistics.median(values):.3f} "
              f"(range {min(values):.3f}-{max(values):.3f}, {len(values)} rounds)")
    steady_loop = statistics.median(r["loop"]["steady_ms"] for r in rounds)
    steady_trainer = statistics.median(r["trainer"]["steady_ms"] for r in rounds)
    print(f"steady examples/s: loop {1000 * eps / steady_loop:,.0f}, Trainer {1000 * eps / steady_trainer:,.0f}; "
          f"1-minute load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rounds, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
