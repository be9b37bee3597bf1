"""The three ways the GPU benchmarks train one recipe, and the interleaved timing they share.

``gpu_throughput.py`` and ``gpu_bench.py`` time the same engines on the same host tensors:

- ``raw``: a hand-written torch loop: batches sliced from a shuffled order, page-locked and copied
  without blocking, ``torch.autocast`` for bf16, ``torch.compile`` when the recipe compiles, and what
  the recipe does by hand that towers does by option (``hand_wrap``: activation checkpointing);
- ``loop``: ``OneDeviceStrategy`` (or the recipe's strategy), ``strategy.prepare`` and ``strategy.run``;
- ``trainer``: ``Trainer.fit`` on the same strategy.

An engine builds its model and optimizer once and returns a block: a function that trains
``recipe.steps`` steps and returns how many it did. ``interleave`` warms each engine up (one block,
timed on its own: allocator, cuDNN/cuBLAS choices, compilation), then runs every engine's block once
per repeat in a rotating order, the device synchronised at both ends of each block.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

import towers

Block = Callable[[], int]


def _same(model: nn.Module) -> nn.Module:
    return model


@dataclass(frozen=True)
class Recipe:
    """What every engine trains, and how.

    ``build`` returns ``(model, make_optimizer)`` (called inside the engine's device); ``loss`` is a
    criterion ``loss(outputs, y, reduction=...)``, or None for a model that returns ``(logits, mean
    token loss)`` from ``model(x, y)``; ``towers_options`` go to ``strategy.prepare`` and ``Trainer``
    alike, ``trainer_options`` to ``Trainer`` only; ``hand_wrap`` is applied to the raw loop's model
    and ``towers_wrap`` to the towers engines' model before ``prepare``.
    """

    build: Callable[[], tuple[nn.Module, Callable[[Any], torch.optim.Optimizer]]]
    data: tuple[torch.Tensor, torch.Tensor]
    batch: int
    steps: int
    precision: str = "32"
    compile: bool | Mapping[str, Any] = False
    loss: Callable[..., torch.Tensor] | None = None
    towers_options: Mapping[str, Any] = field(default_factory=dict)
    trainer_options: Mapping[str, Any] = field(default_factory=dict)
    hand_wrap: Callable[[nn.Module], nn.Module] = _same
    towers_wrap: Callable[[nn.Module], nn.Module] = _same


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queue (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_batches(data: tuple[torch.Tensor, torch.Tensor], batch: int, steps: int,
                 device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``steps`` batches sliced from a shuffled order of ``data``, page-locked and copied without blocking.

    The fast way by hand: a DataLoader over a TensorDataset collates example by example, and was 2x slower
    than towers on the seed CNN.
    """
    xs, ys = data
    pin = (lambda t: t.pin_memory()) if device.type == "cuda" else (lambda t: t)
    order = torch.randperm(len(xs))
    for i in range(steps):
        rows = order[i * batch:(i + 1) * batch]
        yield pin(xs[rows]).to(device, non_blocking=True), pin(ys[rows]).to(device, non_blocking=True)


def _loss(recipe: Recipe, model: Callable[..., Any], x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if recipe.loss is None:
        return model(x, y)[1]
    return recipe.loss(model(x), y, reduction=reduction)


def _compile_options(recipe: Recipe) -> dict[str, Any] | None:
    if recipe.compile is False:
        return None
    return {} if recipe.compile is True else dict(recipe.compile)


def raw_engine(recipe: Recipe, device: torch.device) -> Block:
    """A hand-written torch loop over ``recipe``: no towers at all."""
    torch.manual_seed(0)
    with torch.device(device):
        net, make_opt = recipe.build()
        net = recipe.hand_wrap(net)
    opt = make_opt(net.parameters())
    options = _compile_options(recipe)
    model = torch.compile(net, **options) if options is not None else net
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if recipe.precision == "bf16" else nullcontext

    def block() -> int:
        for x, y in host_batches(recipe.data, recipe.batch, recipe.steps, device):
            with autocast():
                loss = _loss(recipe, model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return recipe.steps
    return block


def towers_device(device: torch.device) -> str:
    """``device`` as a towers user names it (``/gpu:0`` for the GPU)."""
    return "/gpu:0" if device.type == "cuda" else str(device)


def one_device(recipe: Recipe, device: torch.device) -> towers.OneDeviceStrategy:
    """The strategy the towers engines use by default: ``OneDeviceStrategy`` on ``device`` in the recipe's precision."""
    return towers.OneDeviceStrategy(towers_device(device), precision=recipe.precision)


def _built_in_scope(recipe: Recipe, strategy: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The recipe's model (as towers' engines wrap it) and optimizer, made under ``strategy.scope()`` from seed 0."""
    torch.manual_seed(0)
    with strategy.scope():
        net, make_opt = recipe.build()
        net = recipe.towers_wrap(net)
        return net, make_opt(net.parameters())


def loop_engine(recipe: Recipe, device: torch.device, *,
                strategy_fn: Callable[[Recipe, torch.device], Any] = one_device,
                prepared: Callable[[nn.Module, Any], None] | None = None) -> Block:
    """towers' custom loop: ``strategy.prepare(model, opt, compile=..., **towers_options)`` and ``strategy.run``.

    ``prepared(user_model, strategy)`` is called after ``prepare`` (to look at what it did to the model).
    """
    strategy = strategy_fn(recipe, device)
    net, opt = _built_in_scope(recipe, strategy)
    model, opt = strategy.prepare(net, opt, compile=recipe.compile, **recipe.towers_options)
    if prepared is not None:
        prepared(net, strategy)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if recipe.loss is None:
            loss = _loss(recipe, model, x, y)  # the model's token mean: one replica, nothing to rescale
        else:
            loss = towers.compute_average_loss(_loss(recipe, model, x, y, "none"))
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()

    def block() -> int:
        done = 0
        for x, y in strategy.distribute_dataset(recipe.data, recipe.batch, seed=done):
            strategy.run(step, args=(x, y))
            done += 1
            if done == recipe.steps:
                break
        return done
    return block


def trainer_engine(recipe: Recipe, device: torch.device) -> Block:
    """``Trainer.fit`` on ``OneDeviceStrategy``: one epoch of ``recipe.steps`` steps per block."""
    strategy = one_device(recipe, device)
    net, opt = _built_in_scope(recipe, strategy)
    trainer = towers.Trainer(net, opt, recipe.loss, strategy=strategy, ignore_index=-1, compile=recipe.compile,
                             **{**recipe.towers_options, **recipe.trainer_options})

    def block() -> int:
        history = trainer.fit(recipe.data, epochs=1, global_batch_size=recipe.batch, steps_per_epoch=recipe.steps)
        return len(history.history["loss"]) and recipe.steps
    return block


ENGINES: dict[str, Callable[[Recipe, torch.device], Block]] = {
    "raw": raw_engine, "loop": loop_engine, "trainer": trainer_engine}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def interleave(blocks: dict[str, Block], *, device: torch.device, repeats: int,
               deadline: float | None = None) -> dict[str, Any]:
    """Warm each block up, then time ``repeats`` rounds of every block in a rotating order; return what was timed.

    ``deadline`` (a ``time.monotonic()`` value): no engine starts its warm-up when the slowest warm-up so far
    would end past it, and no round starts when the longest round so far would; at least one round is
    run while time is left. An engine that raises is dropped from ``blocks`` (its error kept).
    Returns ``warmup_s``, ``steps`` and ``seconds`` per engine and round, ``rounds``, ``errors`` and ``stopped``
    (None, or why fewer than ``repeats`` rounds or engines were timed).
    """
    out: dict[str, Any] = {"warmup_s": {}, "steps": {}, "seconds": {}, "rounds": 0, "errors": {}, "stopped": None}

    def left() -> float:
        return float("inf") if deadline is None else deadline - time.monotonic()

    for name in list(blocks):
        slowest = max(out["warmup_s"].values(), default=0.0)
        if left() <= slowest:
            out["errors"][name] = f"not warmed up: {left():.0f} s of the budget left, a warm-up took {slowest:.0f} s"
            del blocks[name]
            continue
        t0 = time.monotonic()
        try:
            blocks[name]()
            sync(device)
        except Exception as exc:  # noqa: BLE001 (one failing engine must not lose the others' numbers)
            out["errors"][name] = _error(exc)
            del blocks[name]
        if name not in blocks:
            _free(device)  # now that the exception, and the frames that hold its tensors, are gone
            continue
        out["warmup_s"][name] = time.monotonic() - t0
    names = list(blocks)
    for name in names:
        out["steps"][name], out["seconds"][name] = [], []
    longest = 0.0
    for r in range(repeats):
        if not names:
            out["stopped"] = "no engine left to time"
            break
        if (r > 0 and left() <= longest) or left() <= 0:
            out["stopped"] = f"{r} of {repeats} rounds: the part's time budget would be passed"
            break
        t_round = time.monotonic()
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name not in blocks:
                continue
            try:
                sync(device)
                t0 = time.perf_counter()
                done = blocks[name]()
                sync(device)
            except Exception as exc:  # noqa: BLE001
                out["errors"][name] = _error(exc)
                del blocks[name]
            if name not in blocks:
                _free(device)
                continue
            out["seconds"][name].append(time.perf_counter() - t0)
            out["steps"][name].append(done)
        out["rounds"] = r + 1
        longest = max(longest, time.monotonic() - t_round)
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
