"""Train the seed CNN on bundled digits with DiLoCo on the parameter servers (1 ps task, 2 workers): for slow links.

    towers launch --strategy ps --num-ps 1 --nproc-per-node 3 examples/diloco.py
    towers launch --strategy ps --num-ps 1 --nproc-per-node 3 examples/diloco.py --sync-every 32 --compression int8
    towers launch --strategy ps --num-ps 1 --nproc-per-node 3 examples/diloco.py --mode sync   # a push every step

Each worker trains its own copy of the model with its own Adam for ``--sync-every`` steps on its share of
each global batch; then it sends its parameter change to the ps task, which averages the workers' changes
and applies DiLoCo's outer step (SGD with Nesterov momentum, lr 0.7, momentum 0.9) to the global
parameters, and the workers carry on from the new global values. Every byte goes over the wire (no shared
memory), as between hosts; the chief prints the validation accuracy and the bytes each worker sent per
training example, the figure that tells how much link a job needs.
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
    parser.add_argument("--mode", choices=("diloco", "sync"), default="diloco")
    parser.add_argument("--sync-every", type=int, default=8, help="inner steps between two outer steps (H)")
    parser.add_argument("--compression", choices=("float32", "bf16", "int8", "int4"), default="float32")
    parser.add_argument("--fragments", type=int, default=1, help="sync the parameters in this many parts, in turn")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=64)
    args = parser.parse_args()

    diloco = dict(sync_every=args.sync_every, compression=args.compression, fragments=args.fragments)
    # On a ps task this line serves until the workers finish, then exits the process.
    strategy = towers.ParameterServerStrategy(mode=args.mode, shared_memory=False,
                                              **(diloco if args.mode == "diloco" else {}))
    train_set, test_set = load_digits()
    torch.manual_seed(0)  # the chief's initial weights become the global parameters
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)  # DiLoCo: each worker's inner optimizer

    trainer = towers.Trainer(model, optimizer, loss=F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    history = trainer.fit(train_set, epochs=args.epochs, global_batch_size=args.global_batch_size,
                          validation_data=test_set)
    wire = strategy.wire_stats()
    examples = sum(history.history["examples"]) / strategy.num_replicas_in_sync  # each worker's share
    if strategy.is_chief:
        what = (f"diloco H={args.sync_every} {args.compression} fragments={args.fragments}"
                if args.mode == "diloco" else "sync")
        print(f"{what}: val accuracy {history.history['val_accuracy'][-1]:.4f}, final loss "
              f"{history.history['loss'][-1]:.4f}, {wire['bytes_sent'] / examples:.0f} bytes sent per example "
              f"by this worker ({wire['bytes_sent'] / 1e6:.2f} MB in all)")
    strategy.shutdown()  # tell the ps tasks this worker is done (also done at exit); logs DiLoCo's bytes


if __name__ == "__main__":
    main()
