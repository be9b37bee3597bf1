"""Train the seed CNN on bundled digits with ``Trainer.fit``, under whatever strategy the launcher picked.

    python examples/fit.py                                                  # one process, one device
    towers launch --nproc-per-node 2 --strategy mirrored examples/fit.py   # two replicas, same script

Every replica runs this file; only the chief prints and writes files.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import towers
from towers.datasets import load_digits
from towers.models import SeedCNN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--out-dir", default="towers-out/fit")
    args = parser.parse_args()

    strategy = towers.strategy_from_env()          # one_device, mirrored, ... chosen from outside
    train_set, test_set = load_digits()
    torch.manual_seed(0)                           # the same initial weights on every replica
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)

    trainer = towers.Trainer(model, optimizer, loss=F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    history = trainer.fit(
        train_set, epochs=args.epochs, global_batch_size=args.global_batch_size, validation_data=test_set,
        callbacks=[
            towers.callbacks.ProgressBar(),
            towers.callbacks.BackupAndRestore(f"{args.out_dir}/backup", save_freq=20),   # resume after a crash
            towers.callbacks.ModelCheckpoint(f"{args.out_dir}/best.pt", monitor="val_accuracy", save_best_only=True),
            towers.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
            towers.callbacks.CSVLogger(f"{args.out_dir}/history.csv"),
        ])
    test = trainer.evaluate(test_set)              # reduced over replicas: the same numbers everywhere
    if strategy.is_chief:
        print(f"{strategy.num_replicas_in_sync} replica(s) ({strategy.name}): "
              f"test accuracy {test['accuracy']:.4f}, final loss {history.history['loss'][-1]:.4f}")
    strategy.barrier()
    strategy.shutdown()


if __name__ == "__main__":
    main()
