"""The Trainer's step breakdown at its default period against the breakdown off, same process, interleaved.

Seed CNN on synthetic [B, 1, 28, 28] images, batch 64, Adam, one torch thread, OneDeviceStrategy on
the CPU. Each repeat runs ``Trainer.fit`` for S steps with ``breakdown_every=None`` (the default
period) and with ``breakdown_every=0``, alternating which goes first; a step's time is taken between
the ends of consecutive steps (wall) and as the process's CPU time over the same steps. Reported: ms
per step of each, and on/off ratios, median and range over the repeats. Goal: <= 1.01.

    python benchmarks/breakdown_overhead.py --repeats 7 --steps 200
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.nn.functional as F

import towers
from towers.datasets import synthetic_images
from towers.models import SeedCNN
from towers.training.callbacks.breakdown import DEFAULT_BREAKDOWN_EVERY


class _StepClock(towers.callbacks.Callback):
    """Records wall and process CPU time at the end of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def _ms(times: list[float]) -> float:
    return 1000.0 * (times[-1] - times[1]) / (len(times) - 2)  # from the end of step 2: start-up is out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2 * DEFAULT_BREAKDOWN_EVERY)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    logging.getLogger("towers").setLevel(logging.WARNING)  # the summary lines are not the subject here
    torch.set_num_threads(1)
    strategy = towers.OneDeviceStrategy("cpu")
    data = synthetic_images(args.batch_size * args.steps, seed=0)
    with strategy.scope():
        torch.manual_seed(0)
        net = SeedCNN()
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    # A model and optimizer are prepared once: one Trainer, whose breakdown_every changes between the runs.
    trainer = towers.Trainer(net, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    results: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    trainer.fit(data, epochs=1, global_batch_size=args.batch_size)  # warm-up
    for repeat in range(args.repeats):
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for name in order:
            trainer.breakdown_every = None if name == "on" else 0
            clock = _StepClock()
            trainer.fit(data, epochs=1, global_batch_size=args.batch_size, callbacks=[clock])
            results[name].append((_ms(clock.wall), _ms(clock.cpu)))
    print(f"seed CNN, batch {args.batch_size}, 1 thread, {args.steps} steps x {args.repeats} repeats, "
          f"breakdown every {DEFAULT_BREAKDOWN_EVERY} steps (on) vs breakdown_every=0 (off)")
    for i, what in enumerate(("wall", "CPU")):
        on = [r[i] for r in results["on"]]
        off = [r[i] for r in results["off"]]
        ratios = [a / b for a, b in zip(on, off)]
        print(f"{what:>4} ms/step: on {statistics.median(on):.2f}, off {statistics.median(off):.2f}; on/off "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
