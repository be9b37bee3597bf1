"""A tf.distribute-style custom training loop: the seed CNN on bundled digits, under any strategy.

    python examples/custom_loop.py                                   # one replica (OneDeviceStrategy)
    towers launch --nproc-per-node 2 examples/custom_loop.py         # two mirrored replicas, same script

Each replica computes the loss of its share of the global batch divided by the GLOBAL batch
size (``compute_average_loss``); gradients are summed across replicas, so every step is exactly
the one-device step on the whole global batch. Only the chief prints.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import towers
from towers.datasets import load_digits
from towers.models import SeedCNN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    strategy = towers.strategy_from_env()          # chosen from outside: one_device, mirrored, ...
    train_set, test_set = load_digits(seed=args.seed)
    with strategy.scope():                         # created directly on this replica's device
        torch.manual_seed(args.seed)               # the same initial weights on every replica
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = strategy.prepare(model, optimizer)
    train_batches = strategy.distribute_dataset(train_set, args.global_batch_size, shuffle=True, seed=args.seed)
    test_batches = strategy.distribute_dataset(test_set, args.global_batch_size, shuffle=False)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = towers.compute_average_loss(per_example_loss)   # sum / GLOBAL batch size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def test_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            correct = (model(x).argmax(dim=1) == y).sum()
        return correct, torch.tensor(len(y))

    if strategy.is_chief:
        print(f"{strategy.num_replicas_in_sync} replica(s) with {type(strategy).__name__}, "
              f"global batch {args.global_batch_size}, {len(train_batches)} steps/epoch")
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        total = torch.zeros(())
        for x, y in train_batches:
            total += strategy.reduce("sum", strategy.run(train_step, args=(x, y)))  # = mean loss of the global batch
        model.eval()
        correct = count = torch.zeros((), dtype=torch.long)
        for x, y in test_batches:
            c, n = strategy.run(test_step, args=(x, y))
            correct, count = correct + strategy.reduce("sum", c), count + strategy.reduce("sum", n)
        if strategy.is_chief:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {total.item() / len(train_batches):.4f}, "
                  f"test accuracy {correct.item() / count.item():.4f} ({time.perf_counter() - start:.1f} s)")
    strategy.barrier()
    strategy.shutdown()


if __name__ == "__main__":
    main()
