"""A batch carries its own accounting: loops that interleave iterators give one device's parameters.

Global batch 10 over 4 replicas (shares 3, 3, 2, 2; the last batch of 3 leaves replica 3 empty)
and over 2 replicas, with and without gradient accumulation. Each loop is a plausible user loop
that fetches batches in an order other than "fetch, run, fetch, run":

* an evaluation pass over another distributed dataset between fetching a batch and running it;
* two training datasets (different global batch sizes) interleaved step by step;
* the next batch prefetched before the current one runs;
* a batch kept and run twice.

The one-device reference runs the same loop in this process; each replica count is one spawn
that runs every loop and returns the parameters. Misuse that cannot be made exact is refused:
``compute_average_loss`` on a tensor that did not come from ``distribute_dataset`` (or outside
``run``) under several replicas, and ``run`` before ``prepare`` under every strategy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(240)

ATOL = 1e-5
LOOPS = ("eval_between_fetch_and_run", "two_training_datasets", "prefetched_next_batch", "batch_run_twice")


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(strategy: towers.Strategy, loop: str) -> list[torch.Tensor]:
    """One user loop under ``strategy``; returns the final parameters."""
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    model, optimizer = strategy.prepare(net, optimizer)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def evaluate(x, y):
        with torch.no_grad():
            return towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))

    train_set = strategy.distribute_dataset(_data(23, 1), 10, shuffle=True, seed=5)
    for epoch in range(2):
        if loop == "eval_between_fetch_and_run":
            for x, y in train_set:
                for ex, ey in strategy.distribute_dataset(_data(7, 2), 6, shuffle=False):
                    strategy.reduce("sum", strategy.run(evaluate, args=(ex, ey)))
                strategy.run(step, args=(x, y))
        elif loop == "two_training_datasets":
            other = strategy.distribute_dataset(_data(13, 3), 6, shuffle=True, seed=epoch)
            for (x, y), (ox, oy) in zip(train_set, other):
                strategy.run(step, args=(ox, oy))
                strategy.run(step, args=(x, y))
        elif loop == "prefetched_next_batch":
            it = iter(train_set)
            upcoming = next(it, None)
            while upcoming is not None:
                current, upcoming = upcoming, next(it, None)
                strategy.run(step, args=current)
        elif loop == "batch_run_twice":
            for x, y in train_set:
                strategy.run(step, args=(x, y))
                strategy.run(step, kwargs={"x": x, "y": y})
    return [p.detach().clone() for p in strategy.unwrap(model).parameters()]


def _replica(accumulations: tuple[int, ...]) -> dict:
    results = {}
    for k in accumulations:
        for loop in LOOPS:
            strategy = towers.MirroredStrategy(timeout_s=60, gradient_accumulation_steps=k)
            results[(loop, k)] = train(strategy, loop)
    return results


@pytest.mark.parametrize("replicas", [2, 4])
def test_interleaved_iterators_give_the_one_device_parameters(replicas):
    accumulations = (1, 2)
    per_rank = towers.spawn(_replica, replicas, args=(accumulations,), timeout_s=180)
    for k in accumulations:
        for loop in LOOPS:
            reference = train(towers.OneDeviceStrategy("cpu", info=ProcessInfo(), gradient_accumulation_steps=k), loop)
            for rank, result in enumerate(per_rank):
                for got, want in zip(result[(loop, k)], reference):
                    assert torch.allclose(got, want, atol=ATOL), (loop, k, rank, (got - want).abs().max())


def _misuse() -> dict:
    strategy = towers.MirroredStrategy(timeout_s=60)
    errors = {}
    try:  # run before prepare
        strategy.run(lambda: None)
    except RuntimeError as exc:
        errors["run_before_prepare"] = str(exc)
    net = nn.Linear(5, 3)
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data(4, 1)
    try:  # a plain tensor (no distribute_dataset): the global batch is unknown with 2 replicas
        strategy.run(lambda: towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")))
    except ValueError as exc:
        errors["plain_tensor"] = str(exc)
    try:  # outside run
        with strategy.scope():
            towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    except ValueError as exc:
        errors["outside_run"] = str(exc)
    explicit = strategy.run(lambda: towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"),
                                                                global_batch_size=8))
    errors["explicit_ok"] = bool(torch.isfinite(explicit))
    strategy.shutdown()
    return errors


def test_misuse_that_would_change_the_maths_is_refused_with_the_fix():
    for errors in towers.spawn(_misuse, 2, timeout_s=120):
        assert "before any model was prepared" in errors["run_before_prepare"]
        assert "not given a batch from strategy.distribute_dataset" in errors["plain_tensor"]
        assert "global_batch_size=N" in errors["plain_tensor"]
        assert "outside strategy.run while 2 replicas train in sync" in errors["outside_run"]
        assert errors["explicit_ok"]


def _ps_forgotten_prepare() -> dict | None:
    result = {}
    try:  # refused before connecting to anyone
        towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False, precision="fp16")
    except ValueError as exc:
        result["fp16"] = str(exc)
    strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False, precision="bf16")
    if strategy.is_ps:
        return None
    try:
        strategy.run(lambda: None)
    except RuntimeError as exc:
        result["error"] = str(exc)
    net = nn.Linear(5, 3)
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = next(iter(strategy.distribute_dataset(_data(8, 1), 4)))
    result["dtype"] = str(strategy.run(_inner_dtype, args=(model, x)))
    strategy.shutdown()
    return result


def _inner_dtype(model, x):
    seen = []
    handle = model.module.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    out = model(x)
    handle.remove()
    return (seen[0], out.dtype)


def test_parameter_servers_refuse_a_forgotten_prepare_and_fp16_and_run_bf16():
    per_rank = towers.spawn(_ps_forgotten_prepare, 3, timeout_s=120,
                            env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})
    for result in per_rank[:2]:
        assert "before any model was prepared" in result["error"]
        assert "every worker would train a model of its own" in result["error"]
        assert "Received: precision='fp16'" in result["fp16"] and "Use precision='bf16'" in result["fp16"]
        assert result["dtype"] == "(torch.bfloat16, torch.float32)"  # bf16 inside, float32 out
