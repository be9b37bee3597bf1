"""Per-rank training state and activations of the 69.5M GPT under each layout of 4 processes, from the local tensors.

Layouts: Mirrored (every rank the whole model), sharded (FSDP2 over 4), dp=2,tp=2 (tensor parallel
pairs, FSDP2 across them), tp=4 (one replica split 4 ways), both tp layouts again with sequence
parallelism (``+sp``) and with loss parallelism (``+lp``), and pipelines: pp=2,dp=2 (2 stages, each
sharded over 2), pp=4 (4 stages, 1F1B over 4 micro-batches) and pp=2,tp=2. Under a pipeline the
activations are not counted: the schedule frees a micro-batch's saved tensors after its backward, so
their sum says nothing of the peak. After one AdamW step on a global batch of 8 sequences of 64
tokens, each rank sums the bytes of the tensors it holds: parameters, gradients and optimizer state (for a DTensor,
its local shard). ``activations`` is what the forward keeps for backward on that rank: the tensors
autograd saves, each storage counted once, parameters left out. Also reported: the bytes each rank
sends per step by the layout's collectives, computed from the shapes (not measured): see the docs.

    python benchmarks/model_parallel_memory.py            # ~4 minutes on 2 cores
    python benchmarks/model_parallel_memory.py --layouts "dp=2,tp=2" "dp=2,tp=2 +sp"
    python benchmarks/model_parallel_memory.py --with-loss --layouts "dp=2,tp=2" "dp=2,tp=2 +lp"   # loss parallel

``+lp`` is ``loss_parallel=True`` (the head's logits split over tp for the loss); ``--with-loss`` counts
what the loss keeps for backward too (the step through ``strategy.forward_backward``), where the
logits' difference lies. ``pp=2,tp=2``: each of 2 stages split over 2 processes.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens

LAYOUTS = {"mirrored": ("mirrored", {}), "sharded": ("sharded", {}), "dp=2,tp=2": ("sharded", {"mesh": "dp=2,tp=2"}),
           "tp=4": ("sharded", {"mesh": "tp=4"}),
           "dp=2,tp=2 +sp": ("sharded", {"mesh": "dp=2,tp=2", "sequence_parallel": True}),
           "tp=4 +sp": ("sharded", {"mesh": "tp=4", "sequence_parallel": True}),
           "pp=2,dp=2": ("sharded", {"mesh": "pp=2,dp=2"}), "pp=4": ("sharded", {"mesh": "pp=4"}),
           "pp=2,tp=2": ("sharded", {"mesh": "pp=2,tp=2"}),
           "dp=2,tp=2 +lp": ("sharded", {"mesh": "dp=2,tp=2", "loss_parallel": True}),
           "tp=4 +lp": ("sharded", {"mesh": "tp=4", "loss_parallel": True})}


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


class _SavedForBackward:
    """Counts the bytes of the tensors autograd saves for backward: each storage once, parameters (and views of them,
    such as a weight's transpose) left out. Call ``watch(model)`` once and run the forward under ``pack``."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved: set[int] = set()
        self._parameters: collections.Counter[int] = collections.Counter()  # of the modules running now

    @staticmethod
    def _address(t: torch.Tensor) -> int:
        return (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage().data_ptr()

    def watch(self, model: torch.nn.Module) -> None:
        # Parameters count only while their module runs: FSDP2 frees the gathered ones after it, and an
        # activation may take the same address later.
        def enter(module: torch.nn.Module, _inputs) -> None:
            self._parameters.update(self._address(p) for p in module.parameters(recurse=False))

        def leave(module: torch.nn.Module, _inputs, _output) -> None:
            self._parameters.subtract(self._address(p) for p in module.parameters(recurse=False))

        for module in model.modules():
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        address = self._address(t)
        if self._parameters[address] <= 0 and address not in self._saved:
            self._saved.add(address)
            self.bytes += (t._local_tensor if hasattr(t, "_local_tensor") else t).untyped_storage().nbytes()
        return t


def token_loss(logits: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """The mean token loss of each sequence, normalised by the global batch (towers' custom loop)."""
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none")
    return towers.compute_average_loss(per_token.view(len(yb), -1).mean(1))


def _job(name: str, seq: int, gbs: int, loss_too: bool = False) -> dict:
    kind, options = LAYOUTS[name]
    strategy = towers.MirroredStrategy() if kind == "mirrored" else towers.FullyShardedStrategy(**options)
    config = GPTConfig.small()
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = random_tokens(gbs, GPTConfig(**{**config.__dict__, "block_size": seq}), seed=1)
    saved = _SavedForBackward()
    saved.watch(model)
    pipelined = getattr(strategy, "pipeline_parallel_size", 1) > 1
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=gbs, shuffle=False):
        if pipelined:  # the schedule runs forward and backward over the micro-batches: one call
            strategy.forward_backward(model, xb, yb, token_loss)
            optimizer.step()
            continue

        def step(xb, yb):
            if loss_too:  # the forward and the loss: what loss parallelism changes is the loss's saved logits
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    strategy.forward_backward(model, xb, yb, token_loss)
                optimizer.step()
                return
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                logits = model(xb)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none")
            strategy.backward(towers.compute_average_loss(loss.view(len(yb), -1).mean(1)))
            optimizer.step()
        strategy.run(step, args=(xb, yb))
    params = list(model.parameters())
    raw = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in raw.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params),
            "optimizer": _local_bytes(state), "activations": None if pipelined else saved.bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--with-loss", action="store_true",
                        help="count the loss's saved tensors too (forward and loss through strategy.forward_backward)")
    args = parser.parse_args()
    rows = {}
    for name in args.layouts:
        per_rank = towers.spawn(_job, 4, args=(name, args.seq, args.global_batch, args.with_loss), timeout_s=900)
        rows[name] = per_rank
        mb = [{k: None if v is None else round(v / 2**20, 1) for k, v in r.items()} for r in per_rank]
        worst = max(mb, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        state = round(worst["params"] + worst["grads"] + worst["optimizer"], 1)
        print(f"{name:>14}: per rank (largest) params {worst['params']} MB, grads {worst['grads']} MB, "
              f"optimizer {worst['optimizer']} MB, total {state} MB; activations "
              + (f"{max(r['activations'] for r in mb)} MB" if mb[0]["activations"] is not None else "not counted"),
              flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
