"""Train the seed CNN on bundled digits with ``Trainer.fit`` under parameter servers (1 ps task, 2 workers).

    towers launch --strategy ps --num-ps 1 --nproc-per-node 3 examples/parameter_server.py
    towers launch --strategy ps --num-ps 1 --nproc-per-node 3 examples/parameter_server.py --mode sync
    towers launch --strategy ps --num-ps 1 --nproc-per-node 4 examples/parameter_server.py --kill-worker-at 30
    towers launch --strategy ps --num-ps 1 --nproc-per-node 3 examples/parameter_server.py --no-shared-memory

The last ``--num-ps`` processes are ps tasks: constructing the strategy there serves the
parameters until the workers are done and then exits, so everything below that line runs on
the workers only. The workers split each global batch between them (they are the replicas);
worker 0 is the chief and the only one that prints and writes files.

On one host the workers and the ps task exchange the dense gradients and parameters through
shared memory (``/dev/shm``); ``--no-shared-memory`` puts every byte on the wire, as between hosts.
The chief prints where the bytes went.

``--kill-worker-at STEP`` makes worker 1 kill itself (SIGKILL) at that training step: the job goes
on, the other workers take over its batches, and the History's ``examples`` / ``val_examples``
still count every example of every epoch.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("async", "sync"), default="async")
    parser.add_argument("--staleness", type=int, default=None, help="async only: max updates ahead of the slowest")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--out-dir", default="towers-out/parameter_server")
    parser.add_argument("--kill-worker-at", type=int, default=None, metavar="STEP",
                        help="worker 1 kills itself at this global training step (the others take over its batches)")
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="every byte on the wire, also between processes of one host")
    args = parser.parse_args()

    # On a ps task this line serves until the workers finish, then exits the process.
    strategy = towers.ParameterServerStrategy(mode=args.mode, staleness=args.staleness,
                                              shared_memory=not args.no_shared_memory)
    train_set, test_set = load_digits()
    torch.manual_seed(0)  # the chief's initial weights become the ps tasks' starting values
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)

    trainer = towers.Trainer(model, optimizer, loss=F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    killer = KillWorker(args.kill_worker_at, strategy.replica_id) if args.kill_worker_at is not None else None
    history = trainer.fit(
        train_set, epochs=args.epochs, global_batch_size=args.global_batch_size, validation_data=test_set,
        callbacks=[
            # The lr change reaches the ps tasks' optimizers with the next push.
            towers.callbacks.LearningRateScheduler(lambda epoch, lr: 2e-3 * 0.75 ** epoch),
            towers.callbacks.BackupAndRestore(f"{args.out_dir}/backup", save_freq=20),  # resume after a crash
            *([killer] if killer is not None else []),
        ])
    test = trainer.evaluate(test_set)  # reduced over the workers (through ps task 0): the same numbers everywhere
    if strategy.is_chief:
        stats = strategy.ps_stats()
        print(f"{strategy.num_replicas_in_sync} workers, {len(stats)} ps task(s), mode {args.mode}: "
              f"test accuracy {test['accuracy']:.4f}, final loss {history.history['loss'][-1]:.4f}, "
              f"updates applied {[s['version'] for s in stats]}, per worker {stats[0]['worker_versions']}")
        print(f"examples per epoch {history.history['examples']} of {len(train_set)}, validation "
              f"{history.history['val_examples']} of {len(test_set)}, evaluate {test['examples']:.0f}; "
              f"dead workers {sorted(stats[0]['dead'])}")
        wire = strategy.wire_stats()
        print(f"this worker's traffic with the ps tasks: {wire['shared_memory_bytes'] / 1e6:.1f} MB through shared "
              f"memory, {(wire['bytes_sent'] + wire['bytes_received']) / 1e6:.1f} MB on the wire")
    strategy.shutdown()  # tell the ps tasks this worker is done (also done at exit)


class KillWorker(towers.callbacks.Callback):
    """Worker 1 kills itself at global step ``step``: a fault to watch the others take over its batches."""

    def __init__(self, step: int, replica_id: int):
        super().__init__()
        self.step, self.replica_id = step, replica_id

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.replica_id == 1 and self.trainer.progress.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
