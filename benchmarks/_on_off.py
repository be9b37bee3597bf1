"""What the on/off benchmarks share: a step clock, the seed CNN's Trainer, and the on/off report.

``breakdown_overhead.py`` and ``ledger_overhead.py`` time ``Trainer.fit`` of the seed CNN with one
feature on and off, interleaved in one process; run them from the repository root as scripts.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import towers
from towers.datasets import synthetic_images
from towers.models import SeedCNN


class StepClock(towers.callbacks.Callback):
    """Records wall and process CPU time at the end of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())


def ms(times: list[float]) -> float:
    """Milliseconds per step from the end of step 2 (start-up is out)."""
    return 1000.0 * (times[-1] - times[1]) / (len(times) - 2)


def seed_cnn_trainer(steps: int, batch_size: int):
    """One thread, OneDeviceStrategy on the CPU: the Trainer (prepared once) and its synthetic data."""
    torch.set_num_threads(1)
    strategy = towers.OneDeviceStrategy("cpu")
    data = synthetic_images(batch_size * steps, seed=0)
    with strategy.scope():
        torch.manual_seed(0)
        net = SeedCNN()
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    return towers.Trainer(net, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy), data


def report(results: dict[str, list[tuple[float, float]]]) -> None:
    """Print ms per step of each and the on/off ratios (median and range over the repeats), wall and CPU."""
    for i, what in enumerate(("wall", "CPU")):
        on = [r[i] for r in results["on"]]
        off = [r[i] for r in results["off"]]
        ratios = [a / b for a, b in zip(on, off)]
        print(f"{what:>4} ms/step: on {statistics.median(on):.2f}, off {statistics.median(off):.2f}; on/off "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
