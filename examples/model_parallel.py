"""Model parallelism by placement: the two halves of a GPT on /gpu:0 and /gpu:1, one process.

What TensorFlow's multi-GPU guides call model parallelism: each stage's parameters are created
on its own device (``towers.device``), and the forward pass hands the activations from one
device to the next. Without two GPUs, soft placement puts a missing stage on the CPU, with one
warning naming the device at the line that asked for it (not one per step).

This splits memory, not time: while one stage computes, the other waits. When the goal is
to fit a model too large for one device AND use every device all the time, use sharded data
parallelism instead (``towers.FullyShardedStrategy``, examples/sharded.py; docs/sharded.md).

Run: python examples/model_parallel.py [--steps 30]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens


class TwoStageGPT(nn.Module):
    """A GPT cut in two: embeddings and the first half of the blocks on ``devices[0]``, the rest and head on ``devices[1]``."""

    def __init__(self, config: GPTConfig, devices: tuple[str, str] = ("/gpu:0", "/gpu:1")):
        super().__init__()
        torch.manual_seed(0)
        whole = GPT(config)  # built on the CPU, then each stage moves to where it is placed
        half = config.n_layer // 2
        with towers.device(devices[0]) as first:
            self.stage0 = nn.ModuleDict({"wte": whole.wte, "wpe": whole.wpe,
                                         "blocks": nn.ModuleList(whole.blocks[:half])}).to(first.torch)
        with towers.device(devices[1]) as second:
            self.stage1 = nn.ModuleDict({"blocks": nn.ModuleList(whole.blocks[half:]), "ln_f": whole.ln_f,
                                         "head": whole.head}).to(second.torch)
        self.requested, self.placed = devices, (first, second)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        first, second = (d.torch for d in self.placed)
        idx = idx.to(first)
        x = self.stage0["wte"](idx) + self.stage0["wpe"](torch.arange(idx.size(1), device=first))
        for block in self.stage0["blocks"]:
            x = block(x)
        x = x.to(second)  # the hand-off between the stages: activations forward, gradients back
        for block in self.stage1["blocks"]:
            x = block(x)
        return self.stage1["head"](self.stage1["ln_f"](x))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)

    config = GPTConfig.tiny()
    model = TwoStageGPT(config)
    for i, stage in enumerate((model.stage0, model.stage1)):
        devices = sorted({str(p.device) for p in stage.parameters()})
        count = sum(p.numel() for p in stage.parameters())
        print(f"stage{i}: asked for {model.requested[i]}, placed on {model.placed[i]}: {count:,} parameters on "
              f"{', '.join(devices)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, targets = random_tokens(64, config, seed=1)
    first_loss = last_loss = None
    for step in range(args.steps):
        rows = slice((step * 16) % 64, (step * 16) % 64 + 16)
        logits = model(inputs[rows])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[rows].to(logits.device).flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        first_loss = loss.item() if first_loss is None else first_loss
        last_loss = loss.item()
    print(f"loss {first_loss:.3f} -> {last_loss:.3f} after {args.steps} steps")


if __name__ == "__main__":
    main()
