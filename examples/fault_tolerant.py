"""Train the seed CNN on bundled digits with ``Trainer.fit``, surviving a lost replica group (torchft).

    towers launch --nproc-per-node 2 --strategy ft examples/fault_tolerant.py
    towers launch --nproc-per-node 2 --strategy ft examples/fault_tolerant.py --kill-at 40    # lose group 1 once
    towers launch --nproc-per-node 4 --group-size 2 --strategy ft examples/fault_tolerant.py  # 2 groups x 2

``towers launch`` runs the lighthouse and restarts a lost group alone; the others train on, taking
its share of every global batch, and the restarted group heals from them (docs/fault_tolerance.md).
``--kill-at N`` makes group 1 SIGKILL itself after global step N, on its first run only, to watch
that happen. Every group prints its summary; they agree.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F

import towers
from towers.datasets import load_digits
from towers.models import SeedCNN


class KillAt(towers.callbacks.Callback):
    """SIGKILL this process after global step ``step`` if it is group 1's first run (a demonstration of a lost group)."""

    def __init__(self, strategy: towers.Strategy, step: int):
        super().__init__()
        first_run = os.environ.get("TOWERS_GROUP_RESTART", "0") == "0"
        self.armed = step > 0 and first_run and getattr(strategy, "replica_group_id", 0) == 1
        self.step = step

    def on_train_batch_end(self, batch, logs=None):  # noqa: ANN001 - Keras' signature
        if self.armed and logs["global_step"] >= self.step:
            print(f"group 1: killing myself after step {logs['global_step']}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--kill-at", type=int, default=0, help="group 1 kills itself after this global step (0: never)")
    args = parser.parse_args()

    strategy = towers.strategy_from_env()          # towers launch --strategy ft builds FaultTolerantStrategy
    train_set, test_set = load_digits()
    torch.manual_seed(0)                           # the same initial weights in every group
    model = SeedCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    trainer = towers.Trainer(model, optimizer, loss=F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    history = trainer.fit(train_set, epochs=args.epochs, global_batch_size=args.global_batch_size,
                          callbacks=[KillAt(strategy, args.kill_at)])

    # Evaluation is not one of the job's steps: each group evaluates its copy of the model alone (they are equal).
    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = float((model(x).argmax(dim=1) == y).float().mean())
    group = getattr(strategy, "replica_group_id", 0)
    print(f"group {group}: epochs {history.epoch}, examples per epoch {history.history['examples']}, "
          f"final loss {history.history['loss'][-1]:.4f}, test accuracy {accuracy:.4f}, "
          f"steps not committed {getattr(strategy, 'steps_not_committed', 0)}", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
