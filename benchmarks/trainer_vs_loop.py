"""Trainer.fit against the equivalent custom loop, in the same processes, interleaved.

Seed CNN on synthetic [B, 1, 28, 28] images, per-replica batch 64, Adam, one torch thread per
process. Each repeat times S steps of ``Trainer.fit`` (metrics=["accuracy"], progress bar on,
written to /dev/null) and S steps of the custom loop (``strategy.run`` per step, losses kept on
the replica, one ``reduce`` at the end), alternating which goes first. A step's time is taken
between the ends of consecutive steps, so start-up (fit's set-up, the first iteration) is out.
Reported: ms/step of each and the Trainer/loop ratio, median and range over the repeats, at 1
replica (OneDeviceStrategy) and at 2 (MirroredStrategy). Goal: the Trainer within 5% of the loop.

    python benchmarks/trainer_vs_loop.py                       # 1 and 2 replicas, 7 repeats (~2 min)
    python benchmarks/trainer_vs_loop.py --repeats 11 --steps 60 --json-out trainer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import towers
from towers.datasets import synthetic_images
from towers.models import SeedCNN


class StepClock(towers.callbacks.Callback):
    """Records the wall time at the end of every training step."""

    def __init__(self, times: list[float]):
        super().__init__()
        self.times = times

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())


def towers_loop(strategy: towers.Strategy, model: torch.nn.Module, opt: Any, data: Any,
                global_batch_size: int) -> Callable[[], list[float]]:
    """towers' custom loop over one epoch of ``data`` (cross entropy, ``strategy.run``, one reduce at the end): a
    function that runs it and returns the wall time at the end of every step."""
    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def loop() -> list[float]:
        times, losses = [], []
        for x, y in strategy.distribute_dataset(data, global_batch_size, seed=1):
            losses.append(strategy.run(step, args=(x, y)))
            times.append(time.perf_counter())
        strategy.reduce("sum", torch.stack(losses).sum())  # one reduce, at the end
        return times
    return loop


def _per_step_ms(times: list[float]) -> float:
    return 1000.0 * (times[-1] - times[0]) / (len(times) - 1)


def _measure(steps: int, repeats: int, batch_size: int) -> dict:
    torch.set_num_threads(1)
    strategy = towers.strategy_from_env()
    n = strategy.num_replicas_in_sync
    data = synthetic_images(batch_size * n * (steps + 1), seed=0)
    with strategy.scope():
        torch.manual_seed(0)
        net = SeedCNN()
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    trainer = towers.Trainer(net, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    model, opt = trainer.model, trainer.optimizer  # the same prepared model and optimizer for the loop
    devnull = open(os.devnull, "w")  # noqa: SIM115 (open for the whole run)

    timed_loop = towers_loop(strategy, model, opt, data, batch_size * n)

    def loop() -> float:
        return _per_step_ms(timed_loop())

    def fit() -> float:
        times: list[float] = []
        trainer.fit(data, epochs=1, global_batch_size=batch_size * n,
                    callbacks=[towers.callbacks.ProgressBar(stream=devnull), StepClock(times)])
        return _per_step_ms(times)

    loop(), fit()  # warm-up
    rows = []
    for r in range(repeats):
        strategy.barrier()
        order = (loop, fit) if r % 2 == 0 else (fit, loop)
        timed = {fn.__name__: fn() for fn in order}
        rows.append(timed)
    devnull.close()
    return {"replicas": n, "rows": rows}


def _summary(result: dict) -> dict:
    rows = result["rows"]
    ratios = [r["fit"] / r["loop"] for r in rows]
    return {"replicas": result["replicas"], "loop_ms": statistics.median(r["loop"] for r in rows),
            "fit_ms": statistics.median(r["fit"] for r in rows), "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)], "repeats": len(rows)}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison at each replica count and print one line each (and JSON with --json-out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", default="1,2", help="replica counts (default: 1,2)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per repeat and engine (default: 40)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats (default: 7)")
    p.add_argument("--batch-size", type=int, default=64, help="per-replica batch (default: 64)")
    p.add_argument("--json-out", default=None, help="also write the results here")
    args = p.parse_args(argv)
    summaries = []
    for n in (int(v) for v in args.replicas.split(",")):
        per_rank = towers.spawn(_measure, n, args=(args.steps, args.repeats, args.batch_size), timeout_s=1800,
                                threads_per_process=1, env={"TOWERS_STRATEGY": "one_device" if n == 1 else "mirrored"})
        s = _summary(per_rank[0])
        summaries.append(s)
        print(f"{n} replica(s): loop {s['loop_ms']:.2f} ms/step, Trainer.fit {s['fit_ms']:.2f} ms/step, "
              f"Trainer/loop {s['ratio']:.3f} (range {s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f}, "
              f"{s['repeats']} repeats)", flush=True)
    print(f"1-minute load average: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summaries, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
