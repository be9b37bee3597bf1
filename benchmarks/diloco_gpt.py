"""DiLoCo against MirroredStrategy on a char-level GPT: validation loss at the same number of examples.

Three jobs, one after the other, the same script and data: towers' GPT (2 layers, width 128, 4 heads,
context 64, ~0.4M parameters) on the characters of Python's own ``argparse.py`` and ``textwrap.py``
sources (fixed by the interpreter's version: no download), 90% of the 64-character windows to train,
10% to validate, AdamW 1e-3, global batch 32, the custom loop with ``compute_average_loss`` over each
window's mean token loss:

- ``mirrored``: ``towers launch --nproc-per-node 2 --strategy mirrored`` (2 replicas, one update per step);
- ``diloco8`` / ``diloco32``: ``--nproc-per-node 3 --strategy ps --num-ps 1 --strategy-option mode=diloco
  --strategy-option sync_every=8|32`` (2 workers + 1 ps task; AdamW is each worker's inner optimizer,
  the ps task's outer step is DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9);
- ``diloco8_avg`` / ``diloco32_avg``: ``outer_optimizer=sgd`` (lr 1, no momentum: the workers' models averaged);
  ``diloco8_m05``: Nesterov, lr 1, momentum 0.5;
- ``dilocoH:sgd|nesterov:LR[:MOMENTUM]``: any window and outer rates, e.g. ``diloco8:nesterov:0.5:0.7``.

The chief prints the final model's validation loss; the table gives each DiLoCo run's against Mirrored's.

    python benchmarks/diloco_gpt.py --epochs 2
    python benchmarks/diloco_gpt.py --epochs 8 --setups mirrored,diloco8:nesterov:0.5:0.7
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETUPS = {
    "mirrored": ["--nproc-per-node", "2", "--strategy", "mirrored"],
    "diloco8": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=diloco",
                "--strategy-option", "sync_every=8", "--strategy-option", "shared_memory=false"],
    "diloco32": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=diloco",
                 "--strategy-option", "sync_every=32", "--strategy-option", "shared_memory=false"],
    "diloco8_avg": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=diloco",
                    "--strategy-option", "sync_every=8", "--strategy-option", "outer_optimizer=sgd",
                    "--strategy-option", "shared_memory=false"],
    "diloco32_avg": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=diloco",
                     "--strategy-option", "sync_every=32", "--strategy-option", "outer_optimizer=sgd",
                     "--strategy-option", "shared_memory=false"],
    # Nesterov with a lighter momentum and a full step: lr / (1 - momentum) = 2 times the averaged change at most
    "diloco8_m05": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=diloco",
                    "--strategy-option", "sync_every=8", "--strategy-option", "outer_lr=1.0",
                    "--strategy-option", "outer_momentum=0.5", "--strategy-option", "shared_memory=false"],
}
BLOCK = 64


def _windows():  # noqa: ANN202 - torch is imported inside the job only
    import argparse as argparse_module
    import textwrap

    import torch

    text = "".join(Path(m.__file__).read_text() for m in (argparse_module, textwrap))
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    n = (len(ids) - 1) // BLOCK
    x, y = ids[:n * BLOCK].view(n, BLOCK), ids[1:n * BLOCK + 1].view(n, BLOCK)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(n, generator=g)
    cut = n * 9 // 10
    return len(vocab), (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def _job(epochs: int) -> None:
    """Inside the launched job: train; the chief prints ``RESULT {json}``."""
    import torch
    import torch.nn.functional as F

    import towers
    from towers.models_gpt import GPT, GPTConfig

    strategy = towers.strategy_from_env(timeout_s=600)
    vocab, (x, y), (vx, vy) = _windows()
    torch.manual_seed(0)
    with strategy.scope():
        model = GPT(GPTConfig(vocab_size=vocab, block_size=BLOCK, n_layer=2, n_head=4, n_embd=128))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    data = torch.utils.data.TensorDataset(x, y)
    batches = strategy.distribute_dataset(data, 32, seed=0)

    def step(xb, yb):
        logits = model(xb)
        per_window = F.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none").view(len(yb), -1).mean(1)
        loss = towers.compute_average_loss(per_window)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    began = time.perf_counter()
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        for xb, yb in batches:
            strategy.run(step, args=(xb, yb))
    seconds = time.perf_counter() - began
    if strategy.is_chief:
        net = strategy.unwrap(model)
        with torch.no_grad():
            val = sum(F.cross_entropy(net(vx[i:i + 64]).flatten(0, 1), vy[i:i + 64].flatten(), reduction="sum").item()
                      for i in range(0, len(vx), 64)) / vy.numel()
        print("RESULT " + json.dumps({"val_loss": val, "train_windows": len(x), "seconds": seconds}), flush=True)
    if hasattr(strategy, "shutdown"):
        strategy.shutdown()


def _outer(name: str) -> list[str]:
    """``dilocoH:OPTIMIZER:LR[:MOMENTUM]`` (e.g. ``diloco8:sgd:1.4``, ``diloco8:nesterov:0.5:0.5``): DiLoCo with that
    window and outer optimizer."""
    import re

    match = re.fullmatch(r"diloco(\d+):(sgd|nesterov):([\d.]+)(?::([\d.]+))?", name)
    if match is None:
        raise SystemExit(f"unknown setup {name!r}: one of {sorted(SETUPS)} or dilocoH:sgd|nesterov:LR[:MOMENTUM]")
    h, optimizer, lr, momentum = match.groups()
    options = ["mode=diloco", f"sync_every={h}", f"outer_optimizer={optimizer}", f"outer_lr={lr}",
               "shared_memory=false"] + ([f"outer_momentum={momentum}"] if momentum else [])
    return ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1",
            *[arg for option in options for arg in ("--strategy-option", option)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--setups", default="mirrored,diloco8,diloco32")
    args = parser.parse_args()
    towers = Path(sys.executable).with_name("towers")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "diloco_gpt_job.py"
        script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          "from diloco_gpt import _job\n_job(int(sys.argv[1]))\n")
        for name in args.setups.split(","):
            cmd = [str(towers), "launch", *(SETUPS.get(name) or _outer(name)), str(script), str(args.epochs)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            line = next((ln for ln in done.stdout.splitlines() if "RESULT " in ln), None)
            if done.returncode != 0 or line is None:
                raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            results[name] = json.loads(line.split("RESULT ", 1)[1])
            ref = results.get("mirrored", {}).get("val_loss")
            versus = f", {results[name]['val_loss'] / ref - 1:+.2%} vs mirrored" if ref and name != "mirrored" else ""
            print(f"{name:>9}: val loss {results[name]['val_loss']:.4f} after {args.epochs} epoch(s) of "
                  f"{results[name]['train_windows']} windows, loop {results[name]['seconds']:.1f} s{versus}", flush=True)


if __name__ == "__main__":
    main()
