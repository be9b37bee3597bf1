"""One training script, run unchanged under every strategy by the one-script matrix test.

    python one_script_job.py OUT.json [--workers N] [--fit-data stream|map] [--phases loop,fit]
    towers launch --strategy S ... one_script_job.py OUT.json [--workers N] [--fit-data stream|map] [--phases ...]

It is written as a TensorFlow user writes it: the global batch is ``16 * num_replicas_in_sync``.

1. A custom loop over ``strategy.distribute_dataset`` (map-style tensors, shuffled, seed 0, ``--workers``
   loader workers) for 2 epochs: ``compute_average_loss`` of the per-example cross entropy, SGD with momentum.
2. Its ``Trainer.fit`` twin for 2 epochs on a stream (a torch ``IterableDataset``, read in order) or, with
   ``--fit-data map``, on the same tensors shuffled.

The chief writes OUT.json (the strategy, replica count and global batch) and each phase's weights, as a
user exports them for inference: ``strategy.export_model`` to OUT.json.loop.pt and OUT.json.fit.pt.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset

import towers

EXAMPLES = 75  # a global batch of 32 leaves a ragged last batch of 11
EPOCHS = 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The examples: 75 rows of 6 features, 3 classes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(EXAMPLES, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def model() -> nn.Module:
    """The model every run starts from (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def optimizer_for(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)


class Examples(IterableDataset):
    """A stream of the examples in order (as a reader of a file would give them)."""

    def __iter__(self):
        x, y = data()
        for i in range(EXAMPLES):
            yield x[i], y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fit-data", choices=("stream", "map"), default="stream")
    parser.add_argument("--phases", default="loop,fit", help="which phases to run, in order: loop, fit or both")
    args = parser.parse_args()

    strategy = towers.strategy_from_env()
    GB = 16 * strategy.num_replicas_in_sync
    result = {"strategy": type(strategy).__name__, "replicas": strategy.num_replicas_in_sync, "global_batch": GB}

    phases = args.phases.split(",")
    if strategy.is_chief:  # written first, so that a phase that fails leaves what ran before it
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh)

    if "loop" in phases:
        loop(strategy, GB, args.workers, f"{args.out}.loop.pt")
    if "fit" in phases:
        fit(strategy, GB, args.fit_data, f"{args.out}.fit.pt")
    strategy.shutdown()


def loop(strategy: towers.Strategy, GB: int, workers: int, out: str) -> None:
    """The custom loop: 2 epochs of map-style data, shuffled, through `workers` loader workers; export to `out`."""
    with strategy.scope():
        net = model()
        optimizer = optimizer_for(net)
    model_, optimizer = strategy.prepare(net, optimizer)
    batches = strategy.distribute_dataset(data(), global_batch_size=GB, shuffle=True, seed=0, num_workers=workers)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = towers.compute_average_loss(F.cross_entropy(model_(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for _ in range(EPOCHS):
        for x, y in batches:
            strategy.run(step, args=(x, y))
    strategy.export_model(model_, out)


def fit(strategy: towers.Strategy, GB: int, fit_data: str, out: str) -> None:
    """The Trainer.fit twin: 2 epochs of the stream (in order) or of the map-style data (shuffled); export to `out`."""
    with strategy.scope():
        net = model()
        optimizer = optimizer_for(net)
    trainer = towers.Trainer(net, optimizer, F.cross_entropy, strategy=strategy)
    if fit_data == "stream":
        trainer.fit(Examples(), EPOCHS, GB, shuffle=False)
    else:
        trainer.fit(data(), EPOCHS, GB, shuffle=True)
    strategy.export_model(trainer.model, out)


if __name__ == "__main__":
    main()
