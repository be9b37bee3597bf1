"""gpu_bench.py's GPT parts: the MFU of a ~1B GPT through three engines (a), and its memory policies (c).

(a) ``GPTConfig.large()`` in bf16, compiled, each block's activations checkpointed, at the largest
power-of-two micro-batch that a memory probe finds room for: the raw loop checkpoints each block by
hand (``torch.utils.checkpoint``), towers by ``activation_checkpointing="block"`` (where this towers
lacks the option, its engines get the same hand-made checkpointing and the report says so).

(c) the same model through towers' loop, one policy at a time (five 1B models with their optimizer
state do not fit together): ``activation_checkpointing`` off / block / selective, the raw loop's
hand-made checkpointing, and ``FullyShardedStrategy(cpu_offload=True)`` on one process.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, cast

import torch
from _gpu_engines import ENGINES, Block, Recipe, interleave, loop_engine, raw_engine, towers_device
from torch import nn
from torch.utils.checkpoint import checkpoint

import towers
from towers.diagnostics.flops import count_flops
from towers.diagnostics.peak import device_peak
from towers.models_gpt import GPT, GPTConfig, random_tokens

#: Bytes per parameter an engine keeps between its steps: float32 weights (4) and AdamW's two moments (8).
RESIDENT_BYTES_PER_PARAM = 12
#: Share of the GPU's memory the probe leaves free (compiled kernels' workspaces, fragmentation).
HEADROOM = 0.06
AC_UNAVAILABLE = "activation checkpointing unavailable"


class Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint``: its activations recomputed in backward (written by hand)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Return ``model`` (a towers GPT) with each block checkpointed by hand, as a user without towers writes it."""
    blocks = cast(nn.ModuleList, model.blocks)
    for i, block in enumerate(blocks):
        blocks[i] = Checkpointed(block)
    return model


def _adamw(device: torch.device, fused: bool = True) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=3e-4, fused=fused and device.type == "cuda")


def gpt_recipe(config: GPTConfig, device: torch.device, *, batch: int, steps: int,
               compile: bool | dict[str, Any], policy: str = "block", fused: bool = True) -> Recipe:
    """The GPT recipe: bf16, AdamW (fused on a GPU), the model's own token loss; ``policy`` for towers, by hand for raw."""
    data = random_tokens(batch * (steps + 1), config, seed=0)
    by_hand = checkpoint_blocks if policy == "block" else (lambda m: m)
    return Recipe(build=lambda: (GPT(config), _adamw(device, fused)), data=data, batch=batch, steps=steps,
                  precision="bf16", compile=compile, towers_options={"activation_checkpointing": policy},
                  trainer_options={"log_every_n_steps": 10}, hand_wrap=by_hand)


def towers_has_ac(device: torch.device) -> bool:
    """Whether this towers' ``strategy.prepare`` takes ``activation_checkpointing=`` (a TypeError on the keyword: no)."""
    strategy = towers.OneDeviceStrategy(towers_device(device), precision="bf16")
    try:
        strategy.prepare(nn.Linear(1, 1), activation_checkpointing="off")
    except TypeError as exc:
        if "activation_checkpointing" in str(exc):
            return False
        raise
    return True


def without_ac(recipe: Recipe) -> Recipe:
    """``recipe`` for a towers without ``activation_checkpointing``: its engines checkpoint by hand, as raw does."""
    return replace(recipe, towers_options={}, towers_wrap=recipe.hand_wrap)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def flops_per_token(config: GPTConfig, device: torch.device) -> float:
    """Model FLOPs of one training token (forward and backward, no recomputation): torch's FlopCounterMode on one
    sequence of a plain (not checkpointed) GPT."""
    flops = _count_one_sequence(config, device)
    _free(device)
    return flops / config.block_size


def _count_one_sequence(config: GPTConfig, device: torch.device) -> int:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    x, y = (t.to(device) for t in random_tokens(1, config, seed=0))

    def step() -> None:
        with _autocast(device):
            loss = model(x, y)[1]
        loss.backward()
    return count_flops(step)[1]


def _fits(model: nn.Module, opt: torch.optim.Optimizer, batch: int, config: GPTConfig, device: torch.device) -> bool:
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device)
    try:
        with _autocast(device):
            loss = model(x, x)[1]
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        opt.zero_grad(set_to_none=True)


def choose_batch(config: GPTConfig, device: torch.device, *, start: int, engines: int = 3) -> tuple[int, list[str]]:
    """Return the largest of ``start``, ``start/2``, ... that one eager step of the hand-checkpointed GPT fits, with the
    other ``engines - 1`` engines' weights and AdamW state held in reserve and ``HEADROOM`` left free; and what was tried.

    0 when not even batch 1 fits. On the CPU, ``start`` as it is.
    """
    if device.type != "cuda":
        return start, []
    torch.manual_seed(0)
    with torch.device(device):
        model = checkpoint_blocks(GPT(config))
    opt = _adamw(device)(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    total = torch.cuda.get_device_properties(device).total_memory
    reserve_bytes = (engines - 1) * RESIDENT_BYTES_PER_PARAM * n + HEADROOM * total
    reserve = torch.empty(int(reserve_bytes), dtype=torch.uint8, device=device)
    tried, batch = [], start
    while batch >= 1:
        if _fits(model, opt, batch, config, device):
            tried.append(f"batch {batch} fits")
            break
        tried.append(f"OOM at batch {batch}")
        _free(device)
        batch //= 2
    del reserve, model, opt
    _free(device)
    return batch, tried


def _rows(timed: dict[str, Any], tokens_per_step: int, flops: float, peak: float | None) -> list[dict[str, Any]]:
    raw = [n * tokens_per_step / s for n, s in zip(timed["steps"].get("raw", []), timed["seconds"].get("raw", []))]
    rows = []
    for name in timed["steps"]:
        rates = [n * tokens_per_step / s for n, s in zip(timed["steps"][name], timed["seconds"][name])]
        if not rates:
            continue
        ratios = [r / b for r, b in zip(rates, raw)]
        tokens_s = statistics.median(rates)
        rows.append({"engine": name, "tokens_s": tokens_s, "range": [min(rates), max(rates)],
                     "mfu": tokens_s * flops / peak if peak else None,
                     "vs_raw": statistics.median(ratios) if ratios else None, "warmup_s": timed["warmup_s"][name],
                     "rounds": len(rates)})
    return rows


def run_mfu(config: GPTConfig, device: torch.device, *, steps: int, repeats: int, compile: bool | dict[str, Any],
            batch: int | None, start_batch: int, deadline: float) -> dict[str, Any]:
    """Part (a): tokens/s and MFU of raw torch, towers' loop and ``Trainer.fit`` on ``config``, interleaved."""
    out: dict[str, Any] = {"config": vars(config).copy(), "compile": compile, "steps_per_block": steps,
                           "activation_checkpointing": "block", "notes": []}
    t0 = time.monotonic()
    with torch.device("meta"):
        out["params"] = GPT(config).num_parameters()
    out["flops_per_token"] = flops = flops_per_token(config, device)
    peak = device_peak(device, "bf16")
    out["peak_flops"] = None if peak is None else {"flops_per_second": peak.flops_per_second, "label": peak.label}
    if batch is None:
        batch, out["batch_probe"] = choose_batch(config, device, start=start_batch)
        if batch == 0:
            out["notes"].append("no batch fits: " + ", ".join(out["batch_probe"]))
            return out
    out["batch"], out["tokens_per_step"] = batch, batch * config.block_size
    out["setup_s"] = time.monotonic() - t0
    recipe = gpt_recipe(config, device, batch=batch, steps=steps, compile=compile)
    if not towers_has_ac(device):
        recipe = without_ac(recipe)
        out["activation_checkpointing"] = f"{AC_UNAVAILABLE} in towers (TypeError on the keyword): by hand in every engine"
        out["notes"].append(f"{AC_UNAVAILABLE}: towers' engines got the raw loop's hand-made per-block checkpointing")
    blocks: dict[str, Block] = {}
    for name, make in ENGINES.items():
        try:
            blocks[name] = make(recipe, device)
        except Exception as exc:  # noqa: BLE001 (the other engines still give their numbers)
            out["notes"].append(f"{name} not built: {type(exc).__name__}: {str(exc)[:300]}")
            _free(device)
    timed = interleave(blocks, device=device, repeats=repeats, deadline=deadline)
    del blocks
    if device.type == "cuda":
        torch.compiler.reset()  # compiled code may hold the engines' models: part (c) needs the memory back
    _free(device)
    out["rounds"], out["stopped"], out["errors"] = timed["rounds"], timed["stopped"], timed["errors"]
    out["rows"] = _rows(timed, batch * config.block_size, flops, None if peak is None else peak.flops_per_second)
    return out


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _offload_check(seen: dict[str, Any]) -> Callable[[nn.Module, Any], None]:
    """What ``prepare`` did to the model under a one-process ``FullyShardedStrategy(cpu_offload=True)``."""
    def look(model: nn.Module, strategy: Any) -> None:
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        sharded = any(isinstance(p, DTensor) for p in params)
        places = sorted({str((p.to_local() if isinstance(p, DTensor) else p).device) for p in params})
        seen.update(sharded=sharded, params_on=places)
    return look


def one_config(name: str, recipe: Recipe, device: torch.device, *, repeats: int, deadline: float,
                make: Callable[[], Block]) -> dict[str, Any]:
    """Build ``make()``'s engine and time ``repeats`` single steps after one warm-up: (c)'s row for ``name``.

    The row's ``status`` is ``"ok"`` (with ``peak_gib``, ``step_s``, ``tokens_s``), ``"OOM at batch N"`` (building or
    training ran out of GPU memory), ``"error: ..."`` or ``"not run: ..."`` (the deadline had passed).
    """
    row: dict[str, Any] = {"config": name, "batch": recipe.batch}
    if time.monotonic() >= deadline:
        return {**row, "status": "not run: the part's time budget was spent"}
    if device.type == "cuda":
        row["allocated_before_gib"] = torch.cuda.memory_allocated(device) / 2**30  # > 0: an earlier one leaked
        torch.cuda.reset_peak_memory_stats(device)
    try:
        blocks = {name: make()}
    except torch.cuda.OutOfMemoryError:
        oom = True
    except Exception as exc:  # noqa: BLE001 (one policy's failure is a finding, not the end of the part)
        return {**row, "status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}
    else:
        oom = False
    if oom:
        _free(device)
        return {**row, "status": f"OOM at batch {recipe.batch} (building)"}
    timed = interleave(blocks, device=device, repeats=repeats, deadline=deadline)
    del blocks
    row["peak_gib"] = _peak_gib(device)
    _free(device)
    error = timed["errors"].get(name)
    if error is not None:
        status = f"OOM at batch {recipe.batch}" if "OutOfMemoryError" in error else f"error: {error}"
        return {**row, "status": status, "peak_gib": None}
    step_s = [s / n for s, n in zip(timed["seconds"][name], timed["steps"][name])]
    if not step_s:
        return {**row, "status": timed["stopped"] or "no timed step"}
    median = statistics.median(step_s)
    return {**row, "status": "ok", "step_s": median, "steps_timed": len(step_s),
            "tokens_s": recipe.batch * recipe.data[0].shape[1] / median, "warmup_s": timed["warmup_s"][name]}


def run_memory(config: GPTConfig, device: torch.device, *, batch: int, repeats: int, compile: bool | dict[str, Any],
               deadline: float) -> dict[str, Any]:
    """Part (c): peak memory and step time of each memory policy on ``config`` at ``batch``, one after another."""
    out: dict[str, Any] = {"batch": batch, "compile": compile, "rows": [], "notes": []}
    has_ac = towers_has_ac(device)
    if not has_ac:
        out["notes"].append(f"{AC_UNAVAILABLE} in towers (TypeError on the keyword): 'off' is towers' loop without it")
    for policy in ("off", "block", "selective"):
        recipe = gpt_recipe(config, device, batch=batch, steps=1, compile=compile, policy=policy)
        if not has_ac and policy != "off":
            out["rows"].append({"config": policy, "batch": batch, "status": AC_UNAVAILABLE})
            continue
        recipe = recipe if has_ac else replace(recipe, towers_options={})
        out["rows"].append(one_config(policy, recipe, device, repeats=repeats, deadline=deadline,
                                       make=functools.partial(loop_engine, recipe, device)))
    hand = gpt_recipe(config, device, batch=batch, steps=1, compile=compile, policy="block")
    out["rows"].append(one_config("block, by hand (raw torch)", hand, device, repeats=repeats, deadline=deadline,
                                   make=lambda: raw_engine(hand, device)))
    offload = gpt_recipe(config, device, batch=batch, steps=1, compile=False, policy="block", fused=False)
    out["rows"].append(_offload_row(offload if has_ac else without_ac(offload), device, repeats=repeats,
                                    deadline=deadline))
    out["notes"].append("FullyShardedStrategy(cpu_offload=True) runs with block checkpointing, eager, and a plain "
                        "(not fused) AdamW: its optimizer steps on the CPU.")
    return out


def _offload_row(recipe: Recipe, device: torch.device, *, repeats: int, deadline: float) -> dict[str, Any]:
    """(c)'s last row: one process of ``FullyShardedStrategy(cpu_offload=True)``, and whether it sharded at all."""
    seen: dict[str, Any] = {}
    made: list[Any] = []

    def fsdp(recipe: Recipe, device: torch.device) -> Any:
        made.append(towers.FullyShardedStrategy(precision="bf16", cpu_offload=True))
        return made[-1]
    try:
        row = one_config("FullyShardedStrategy(cpu_offload=True), one process", recipe, device, repeats=repeats,
                          deadline=deadline, make=lambda: loop_engine(recipe, device, strategy_fn=fsdp,
                                                                      prepared=_offload_check(seen)))
    finally:
        for strategy in made:
            strategy.shutdown()  # a one-process group it may have started
    row.update(seen)
    if seen and not seen["sharded"]:
        row["finding"] = (f"did not shard on one process: parameters are plain tensors on {', '.join(seen['params_on'])}, "
                          "so cpu_offload had no effect")
    return row
