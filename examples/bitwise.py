"""Bit for bit: the same training gives the same bits in one process and on any number of replicas.

    python examples/bitwise.py                                                   # one process
    towers launch --nproc-per-node 3 --strategy mirrored examples/bitwise.py     # 3 replicas
    towers launch --nproc-per-node 2 --strategy sharded examples/bitwise.py      # 2 replicas, each holds 1/2

Each run prints the same ``digest``: a SHA-256 of every parameter and every Adam state tensor after
training, and of the losses the loop logged. The script is the README's loop with one change:
``towers.strategy_from_env(bitwise=True)``. The global batch (48) is cut into micro-batches (here a
twelfth of it, 4 examples, chosen by towers and logged), and their gradients are summed over one
fixed binary tree whatever the replica count. Keep one intra-op thread per process (this script
sets it) so that CPU kernels split no sum by thread count: the runs then differ in nothing.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn.functional as F

import towers
from towers.datasets import load_digits
from towers.models import SeedCNN


def digest(tensors: list[torch.Tensor], losses: list[float]) -> str:
    """A SHA-256 of the tensors' bytes and the losses: equal only if every bit is."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    h.update(repr(losses).encode())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    strategy = towers.strategy_from_env(bitwise=True)
    train_set, _ = load_digits()
    torch.manual_seed(0)
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = strategy.prepare(model, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        strategy.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    losses: list[float] = []
    for epoch in range(args.epochs):
        for x, y in strategy.distribute_dataset(train_set, global_batch_size=48, seed=epoch):
            losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y))).item())

    # Every parameter and Adam state tensor, gathered whole (a sharded strategy's DTensors: a collective).
    state = [*strategy.unwrap(model).state_dict().values(),
             *(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]
    whole = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in state]
    if strategy.is_chief:
        print(f"{type(strategy).__name__}, {strategy.num_replicas_in_sync} replica(s): {len(losses)} updates, "
              f"last loss {losses[-1]:.6f}, digest {digest(whole, losses)}")


if __name__ == "__main__":
    main()
