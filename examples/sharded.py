"""Sharded data parallelism: a small GPT language model trained with FullyShardedStrategy (FSDP2).

    towers launch --nproc-per-node 2 --strategy sharded examples/sharded.py            # 2 replicas, each holds 1/2
    towers launch --nproc-per-node 4 --strategy sharded examples/sharded.py --resume   # resume on 4 (resharded)
    python examples/sharded.py                                                         # one process: nothing to shard

The script is the same as under every other strategy (``strategy_from_env``, ``scope``,
``prepare``, ``distribute_dataset``, ``run``, ``reduce``). What changes with ``--strategy
sharded``: each replica keeps only its shard of the parameters, gradients and AdamW state
(it prints how many bytes), checkpoints are sharded directories written by every rank at once
(and can be resumed by a different number of processes), and the end of training exports the
full model for inference in one call.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens


def _local_mb(tensors) -> float:
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None)
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=96, help="random token sequences in the data set")
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny", help="tiny: 32k parameters; small: ~70M")
    parser.add_argument("--out", default="sharded-out", help="directory for the checkpoint and the exported model")
    parser.add_argument("--resume", action="store_true", help="resume from OUT/checkpoint when it exists")
    args = parser.parse_args()

    info = towers.cluster.from_env()
    # `towers launch --strategy sharded` (or fsdp) picks it from outside; without --strategy, sharded too.
    strategy = towers.strategy_from_env(info) if info.strategy else towers.FullyShardedStrategy(info=info)
    config = GPTConfig.tiny() if args.size == "tiny" else GPTConfig.small()
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = strategy.prepare(model, optimizer)  # sharded here: each rank keeps 1/N of every block
    data = random_tokens(args.sequences, config, seed=1)
    batches = strategy.distribute_dataset(data, args.global_batch_size, shuffle=True, seed=0)

    # The one checkpoint recipe of every strategy: model, optimizer, data position and your values.
    manager = towers.checkpoint.CheckpointManager(os.path.join(args.out, "checkpoints"), strategy=strategy,
                                                  max_to_keep=2)
    first_epoch = 0
    if args.resume:
        state = manager.restore({"model": model, "optimizer": optimizer, "data": batches})  # resharded for this job
        if state is not None:
            first_epoch = int(state["epoch"]) + 1
            if strategy.is_chief:
                info = towers.checkpoint.checkpoint_info(manager.latest_checkpoint)
                print(f"resumed from {manager.latest_checkpoint} (written by {info['num_replicas']} process(es) under "
                      f"{info['strategy']}) at epoch {first_epoch}")

    params = list(model.parameters())
    if strategy.is_chief:
        full = sum(p.numel() for p in params) * 4 / 2**20
        print(f"{strategy.name}: {strategy.num_replicas_in_sync} replica(s); this rank holds {_local_mb(params):.2f} MB "
              f"of the model's {full:.2f} MB of parameters")

    def step(x, y):
        logits = model(x)
        per_sequence = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(x), -1).mean(1)
        loss = towers.compute_average_loss(per_sequence)  # divided by the GLOBAL batch size
        loss.backward()
        strategy.clip_grad_norm_(model.parameters(), 1.0)  # the global norm, over every rank's shards
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for epoch in range(first_epoch, args.epochs):
        total, count = 0.0, 0
        for x, y in batches:
            total += float(strategy.reduce("sum", strategy.run(step, args=(x, y))))
            count += 1
        path = manager.save({"model": model, "optimizer": optimizer, "data": batches, "epoch": epoch})
        if strategy.is_chief:
            grads_and_state = _local_mb(p.grad for p in params) + _local_mb(
                v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
            print(f"epoch {epoch + 1}: loss {total / count:.4f}; this rank's gradients + AdamW state "
                  f"{grads_and_state:.2f} MB; checkpoint {path}")

    exported = os.path.join(args.out, "model.safetensors")
    strategy.export_model(model, exported)               # one call: the full model, gathered to and written by the chief
    if strategy.is_chief:
        weights = towers.checkpoint.load_exported(exported)  # plain tensors: GPT(config).load_state_dict(weights)
        print(f"exported the full model for inference: {exported} ({len(weights)} tensors)")
    strategy.barrier()


if __name__ == "__main__":
    main()
