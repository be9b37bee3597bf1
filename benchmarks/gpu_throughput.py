"""Examples/s on one GPU: raw torch, towers' custom loop and ``Trainer.fit``, in fp32, bf16 and compiled.

Two models: the seed CNN (synthetic [B, 1, 28, 28] images, batch 256, Adam) and the 69.5M-parameter
GPT (``GPTConfig.small()``: context 256, batch 16 sequences, AdamW, the model's own token loss).
Each engine reads the same CPU tensors as a user's job would (page-locked, copied without
blocking):

- ``raw``: a hand-written torch loop (batches sliced from a shuffled order, page-locked, ``torch.autocast``
  for bf16, ``torch.compile`` for compiled);
- ``loop``: ``OneDeviceStrategy("/gpu:0", precision=...)``, ``strategy.prepare`` and ``strategy.run``;
- ``trainer``: ``Trainer.fit`` on the same strategy (not in the compiled mode: one compilation per
  engine is the cost that decides how long this takes);
- ``trainer_waits`` (``--waits-variant``): the Trainer as it was, waiting for the GPU at every step.

A block is S steps of one engine, timed with the device synchronised at both ends, so the
iterator's start is in. Every repeat runs each engine's block once, in a rotating order; reported
are examples/s (median and range over the repeats) and each engine over raw torch.

    python benchmarks/gpu_throughput.py                                   # both models, ~4 min on an H100
    python benchmarks/gpu_throughput.py --models gpt --modes bf16 --repeats 3 --json-out gpu.json
    python benchmarks/gpu_throughput.py --device cpu --tiny-gpt --steps 3 --repeats 1  # a smoke run, no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from _gpu_engines import ENGINES, Block, Recipe, interleave, trainer_engine

from towers.datasets import synthetic_images
from towers.models import SeedCNN
from towers.models_gpt import GPT, GPTConfig, random_tokens

MODES = ("fp32", "bf16", "compiled")  # compiled: bf16 and torch.compile (inductor)
BATCH = {"cnn": 256, "gpt": 16}
_GPT_CONFIG = [GPTConfig.small()]
WAITS_VARIANT = [False]  # --waits-variant  # --tiny-gpt: GPTConfig.tiny(), for a smoke run


def _data(model_name: str, examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    if model_name == "cnn":
        return synthetic_images(examples, seed=0).tensors
    return random_tokens(examples, _GPT_CONFIG[0], seed=0)


def make_recipe(model_name: str, mode: str, steps: int, batch: int | None = None) -> Recipe:
    """The recipe of ``model_name`` (``cnn``: Adam, cross-entropy; ``gpt``: AdamW, its own token loss) in ``mode``."""
    batch = batch or BATCH[model_name]
    data = _data(model_name, batch * (steps + 1))
    precision, compiled = ("32" if mode == "fp32" else "bf16"), mode == "compiled"
    if model_name == "cnn":
        return Recipe(build=lambda: (SeedCNN(), lambda params: torch.optim.Adam(params, lr=1e-3)), data=data,
                      batch=batch, steps=steps, precision=precision, compile=compiled, loss=F.cross_entropy)
    config = _GPT_CONFIG[0]
    return Recipe(build=lambda: (GPT(config), lambda params: torch.optim.AdamW(params, lr=3e-4)), data=data,
                  batch=batch, steps=steps, precision=precision, compile=compiled)


def _trainer_waits_engine(recipe: Recipe, device: torch.device) -> Block:
    """``trainer`` as it was before it stopped waiting for the GPU inside a step (--waits-variant): metrics
    reduced at every step (``log_every_n_steps=1``, what one replica did) and labels counted on the device."""
    import towers.training._step_runner as trainer_module  # where the training step counts labels

    inner = trainer_engine(replace(recipe, trainer_options={"log_every_n_steps": 1}), device)

    def on_device(parts, ignore_index, *, shifted=False):
        if not isinstance(parts.labels, torch.Tensor):
            return parts.size()
        return int((parts.labels[..., 1:] if shifted else parts.labels).ne(ignore_index).sum())

    def block() -> int:
        kept = trainer_module.label_count
        trainer_module.label_count = on_device
        try:
            return inner()
        finally:
            trainer_module.label_count = kept
    return block


def measure(model_name: str, mode: str, device: torch.device, steps: int, repeats: int, *,
            batch: int | None = None, deadline: float | None = None) -> dict:
    """Time every engine of ``model_name`` in ``mode``; return examples/s per engine and repeat.

    ``deadline`` (``time.monotonic()``): stop early, as ``interleave`` does; ``stopped`` and ``errors`` say what was left.
    """
    recipe = make_recipe(model_name, mode, steps, batch)
    makers = {**ENGINES, "trainer_waits": _trainer_waits_engine}
    engines = {name: make(recipe, device) for name, make in makers.items()
               if not (name.startswith("trainer") and mode == "compiled")
               and (name != "trainer_waits" or WAITS_VARIANT[0])}
    timed = interleave(engines, device=device, repeats=repeats, deadline=deadline)
    del engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rates = {name: [n * recipe.batch / s for n, s in zip(timed["steps"][name], timed["seconds"][name])]
             for name in timed["steps"]}
    return {"model": model_name, "mode": mode, "batch": recipe.batch, "steps": steps,
            "warmup_s": sum(timed["warmup_s"].values()), "rates": rates, "errors": timed["errors"],
            "stopped": timed["stopped"]}


def summarise(result: dict) -> list[dict]:
    """One row per engine: median and range of examples/s, and the median ratio to raw torch (None without raw);
    an engine that failed gives a row with its ``error``."""
    raw = result["rates"].get("raw", [])
    rows: list[dict[str, Any]] = []
    for name, values in result["rates"].items():
        if not values:
            continue
        ratios = [v / r for v, r in zip(values, raw)]
        rows.append({"model": result["model"], "mode": result["mode"], "engine": name,
                     "examples_s": statistics.median(values), "range": [min(values), max(values)],
                     "vs_raw": statistics.median(ratios) if ratios else None, "warmup_s": result["warmup_s"]})
    rows += [{"model": result["model"], "mode": result["mode"], "engine": name, "error": error}
             for name, error in result.get("errors", {}).items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    p.add_argument("--models", default="cnn,gpt", help="comma-separated, of cnn, gpt (default: both)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=30, help="timed steps per block (default: 30)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default: 5)")
    p.add_argument("--tiny-gpt", action="store_true", help="the tests' tiny GPT instead (a smoke run)")
    p.add_argument("--waits-variant", action="store_true",
                   help="also time the Trainer as it was: waiting for the GPU at every step (trainer_waits)")
    p.add_argument("--json-out", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    models, modes = args.models.split(","), args.modes.split(",")
    bad = [m for m in models if m not in BATCH] + [m for m in modes if m not in MODES]
    if bad or args.steps < 1 or args.repeats < 1:
        p.error(f"unknown model or mode {bad}, or steps/repeats < 1. Received: models={args.models}, "
                f"modes={args.modes}, steps={args.steps}, repeats={args.repeats}.")
    device = torch.device(args.device)
    WAITS_VARIANT[0] = args.waits_variant
    if args.tiny_gpt:
        _GPT_CONFIG[0] = GPTConfig.tiny()
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no GPU here. Run it on a GPU machine, or pass --device cpu.")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
        print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}, CUDA {torch.version.cuda}",
              flush=True)
    rows = []
    for model_name in models:
        for mode in modes:
            try:
                result = measure(model_name, mode, device, args.steps, args.repeats)
            except Exception as exc:  # one failing mode must not lose the others' numbers
                print(f"{model_name} {mode}: failed: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"model": model_name, "mode": mode, "error": f"{type(exc).__name__}: {exc}"})
                continue
            for row in summarise(result):
                rows.append(row)
                if "error" in row:
                    print(f"{row['model']} {row['mode']} {row['engine']}: failed: {row['error']}", flush=True)
                    continue
                vs_raw = "-" if row["vs_raw"] is None else f"{row['vs_raw']:.3f}"
                print(f"{row['model']:4} {row['mode']:9} {row['engine']:13} {row['examples_s']:10.1f} ex/s "
                      f"({row['range'][0]:.1f}-{row['range'][1]:.1f})  {vs_raw}x raw  "
                      f"warm-up {row['warmup_s']:.1f} s", flush=True)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "args": vars(args), "rows": rows}, f,
                      indent=1)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
