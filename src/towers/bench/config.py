"""What ``towers bench`` measures: a frozen, self-validating ``BenchConfig`` and the parsers of its list flags.

Importing this module does not import torch, so the CLI can validate flags before paying for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from towers.cluster import roles
from towers.errors import InvalidArgumentError

if TYPE_CHECKING:
    from towers.bench.workloads import WorkloadSpec

__all__ = ["STRATEGIES", "OPTIMIZERS", "LOSSES", "BenchConfig", "available_cores", "bench_strategy", "parse_replicas",
           "parse_strategies", "parse_shape"]

#: Optimizers the benchmark can use; every engine builds the same one with the same learning rate.
OPTIMIZERS = ("sgd", "adam")

#: Losses the benchmark can train with (``cross_entropy`` takes class labels, ``mse`` targets shaped like the output).
LOSSES = ("cross_entropy", "mse")

def _bench_strategies() -> tuple[str, ...]:
    names: list[str] = []
    for entry in roles.STRATEGIES:
        if entry.multi_process:  # strategies with ps tasks are measured in each update mode
            names += [f"{entry.name}_async", f"{entry.name}_sync"] if entry.has_ps else [entry.name]
    return tuple(names)


#: Strategies ``towers bench --strategies`` accepts (from the strategy table; ``<name>_async``/``<name>_sync``
#: for strategies with ps tasks); raw DDP is always measured beside them.
STRATEGIES = _bench_strategies()


def bench_strategy(name: str) -> tuple[str, dict[str, str]]:
    """Return ``(strategy name, options)`` for a ``STRATEGIES`` entry (``"ps_sync"`` -> ``("ps", {"mode": "sync"})``)."""
    for mode in ("async", "sync"):
        base = name.removesuffix(f"_{mode}")
        if base != name and roles.strategy_entry(base).has_ps:
            return base, {"mode": mode}
    return name, {}


def available_cores() -> int:
    """Return how many CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure: replica counts, strategies, steps, repeats, batch and threads (validated on construction).

    ``interleave_steps``: engines take turns every that many timed steps (0: one turn of ``steps``
    each per repeat). ``timeout_s`` bounds each spawned job; None picks a bound from the amount of work.
    ``model``: ``module:factory`` of the user's ``nn.Module`` (None: the seed CNN), fed random
    ``input_shape`` inputs with ``num_classes`` labels, or ``dataset`` (``module:factory`` of a
    dataset of ``(input, target)`` pairs); ``loss``: one of ``LOSSES``.
    """

    replicas: tuple[int, ...] = (1, 2)
    strategies: tuple[str, ...] = ("mirrored",)
    steps: int = 30
    warmup: int = 5
    repeats: int = 5
    interleave_steps: int = 5
    batch_size: int = 64
    threads: int = 1
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    timeout_s: float | None = None
    model: str | None = None
    dataset: str | None = None
    input_shape: tuple[int, ...] = (1, 28, 28)
    num_classes: int = 10
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        replicas = tuple(self.replicas)
        if not replicas or any(not isinstance(n, int) or n < 1 for n in replicas):
            raise InvalidArgumentError(f"replicas must be positive integers, e.g. (1, 2). Received: {self.replicas!r}. "
                                       "Pass --replicas 1,2.")
        if len(set(replicas)) != len(replicas):
            raise InvalidArgumentError(f"replicas must not repeat a count. Received: {self.replicas!r}. Pass each count once.")
        object.__setattr__(self, "replicas", tuple(sorted(replicas)))
        strategies = tuple(s.lower().replace("-", "_") for s in self.strategies)
        unknown = [s for s in strategies if s not in STRATEGIES]
        if not strategies or unknown:
            raise InvalidArgumentError(f"strategies must be among {', '.join(STRATEGIES)}. Received: {self.strategies!r}. "
                                       "Pass e.g. --strategies mirrored,ps_async (raw DDP is always measured beside them).")
        object.__setattr__(self, "strategies", tuple(dict.fromkeys(strategies)))
        for name, low in (("steps", 1), ("warmup", 0), ("repeats", 1), ("interleave_steps", 0), ("batch_size", 1),
                          ("threads", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}. Received: {value!r}. "
                                           f"Pass --{name.replace('_', '-')} {max(low, 1)} or more.")
        if self.optimizer not in OPTIMIZERS:
            raise InvalidArgumentError(f"optimizer must be one of {OPTIMIZERS}. Received: {self.optimizer!r}.")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise InvalidArgumentError(f"timeout_s must be > 0 seconds (or None for automatic). Received: {self.timeout_s}.")
        for name in ("model", "dataset"):
            ref = getattr(self, name)
            if ref is not None and (not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":"))):
                raise InvalidArgumentError(f"{name} must be 'module:factory' (e.g. mypkg.models:build) or 'file.py:factory'. "
                                           f"Received: {ref!r}. Pass --{name} module:factory.")
        if self.dataset is not None and self.model is None:
            raise InvalidArgumentError("--dataset needs --model: the seed CNN trains on its own synthetic images. "
                                       f"Received: --dataset {self.dataset!r} without --model.")
        shape = tuple(self.input_shape)
        if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
            raise InvalidArgumentError("input_shape must be positive integers, e.g. (3, 32, 32). "
                                       f"Received: {self.input_shape!r}. Pass --input-shape 3,32,32.")
        object.__setattr__(self, "input_shape", shape)
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise InvalidArgumentError(f"num_classes must be an integer >= 1. Received: {self.num_classes!r}.")
        if self.loss not in LOSSES:
            raise InvalidArgumentError(f"loss must be one of {LOSSES}. Received: {self.loss!r}.")

    def workload_spec(self) -> "WorkloadSpec":
        """Return the workload every engine runs: one pass holds the warm-up and the timed steps."""
        from towers.bench.workloads import WorkloadSpec

        return WorkloadSpec(batch_size=self.batch_size, steps_per_epoch=self.warmup + self.steps,
                            optimizer=self.optimizer, lr=self.lr, seed=self.seed, model=self.model,
                            dataset=self.dataset, input_shape=self.input_shape, num_classes=self.num_classes,
                            loss=self.loss)

    def job_timeout_s(self, num_replicas: int, num_engines: int, cores: int | None = None) -> float:
        """Return the deadline of one spawned job: explicit, or ~10x a slow step time per step, plus start-up."""
        if self.timeout_s is not None:
            return self.timeout_s
        oversubscription = max(1.0, num_replicas * self.threads / (cores or available_cores()))
        steps = self.repeats * num_engines * (self.warmup + self.steps)
        per_step_s = 0.25 * oversubscription * max(1.0, self.batch_size / 64)
        return 120.0 + steps * per_step_s


def parse_replicas(text: str) -> tuple[int, ...]:
    """Return the replica counts in a comma-separated flag value such as ``"1,2,4"``.

    Raises:
        ValueError: on an empty, non-integer or non-positive entry, saying what was expected.
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        counts = tuple(int(p) for p in parts)
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts):
        raise InvalidArgumentError(f"--replicas must be a comma-separated list of positive integers. Received: {text!r}. "
                                   "Pass e.g. --replicas 1,2.")
    return counts


def parse_strategies(text: str) -> tuple[str, ...]:
    """Return the strategy names in a comma-separated flag value such as ``"mirrored,ps_async"``.

    Raises:
        ValueError: on an empty list or an unknown name, listing the accepted ones.
    """
    names = tuple(p.strip().lower().replace("-", "_") for p in str(text).split(",") if p.strip())
    unknown = [n for n in names if n not in STRATEGIES]
    if not names or unknown:
        raise InvalidArgumentError(f"--strategies must be a comma-separated list of {', '.join(STRATEGIES)}. "
                                   f"Received: {text!r}. Pass e.g. --strategies mirrored (raw DDP is always measured).")
    return names


def parse_shape(text: str) -> tuple[int, ...]:
    """Return the dimensions in a flag value such as ``"3,32,32"`` (or ``"3x32x32"``).

    Raises:
        ValueError: on an empty, non-integer or non-positive dimension, with an example.
    """
    parts = [p.strip() for p in str(text).replace("x", ",").split(",") if p.strip()]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise InvalidArgumentError(f"--input-shape must be positive integers separated by commas, one example's shape without "
                                   f"the batch dimension. Received: {text!r}. Example: --input-shape 3,32,32.")
    return dims
