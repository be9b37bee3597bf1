"""What the benchmark trains: the seed CNN on synthetic images, as raw torch DDP and as towers user code.

Every workload has the same two calls: ``start_epoch()`` (untimed: a fresh pass over the data) and
``train(steps)`` (timed by the runner). Data is generated once, before any timing; warm-up steps are
run by the runner outside the timed region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from towers.bench.config import OPTIMIZERS
from towers.datasets import synthetic_images
from towers.models import SeedCNN

__all__ = ["OPTIMIZERS", "WorkloadSpec", "Workload", "IdleWorkload", "RawTorchWorkload", "TowersWorkload",
           "make_dataset"]

@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """The training job every engine runs: seed CNN, per-replica batch, optimizer, steps per pass."""

    batch_size: int = 64
    steps_per_epoch: int = 35
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    image_size: int = 28
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size (per replica) must be >= 1. Received: {self.batch_size}.")
        if self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1. Received: {self.steps_per_epoch}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}. Received: {self.optimizer!r}.")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0. Received: {self.lr}.")

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """Return this spec's optimizer over ``params``."""
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)

    def make_model(self) -> nn.Module:
        """Return a freshly initialised seed CNN (same weights for the same seed)."""
        torch.manual_seed(self.seed)
        return SeedCNN(self.num_classes)


def make_dataset(spec: WorkloadSpec, num_replicas: int) -> torch.utils.data.TensorDataset:
    """Return synthetic images for one pass: ``steps_per_epoch`` global batches of ``num_replicas * batch_size``."""
    n = spec.steps_per_epoch * num_replicas * spec.batch_size
    return synthetic_images(n, size=spec.image_size, num_classes=spec.num_classes, seed=spec.seed)


class Workload:
    """A model, an optimizer and the data of one engine; the runner calls ``start_epoch`` then ``train``."""

    #: What ran, for the report (e.g. ``"torch DDP"``, ``"MirroredStrategy"``).
    engine: str = "?"
    #: Replicas that train together in each step (global examples/s = steps * batch * this / time).
    num_replicas: int = 1

    def start_epoch(self) -> None:
        """Begin a fresh pass over the data (untimed)."""
        raise NotImplementedError

    def train(self, steps: int) -> None:
        """Run ``steps`` training steps on the current pass."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what this workload holds (no-op by default)."""


class IdleWorkload(Workload):
    """This rank's part in a run it sits out (a 1-replica baseline runs on rank 0): nothing; it waits at the barriers."""

    engine = "idle"

    def start_epoch(self) -> None:
        """Nothing to do."""

    def train(self, steps: int) -> None:
        """Nothing to do."""


class RawTorchWorkload(Workload):
    """The baseline written by hand: ``DistributedDataParallel`` (or a plain module on one process) and SGD/Adam.

    Batches are views into a pre-generated tensor (this rank's contiguous share of each global
    batch, the order ``distribute_dataset(shuffle=False)`` gives), so the baseline pays nothing for data.
    ``process_group``: DDP's group (default: the whole job; a subgroup when the job also has ps tasks).
    """

    def __init__(self, spec: WorkloadSpec, *, rank: int = 0, world_size: int = 1, use_ddp: bool | None = None,
                 process_group: Any = None):
        self.spec = spec
        use_ddp = world_size > 1 if use_ddp is None else use_ddp
        model = spec.make_model()
        if use_ddp:
            model = nn.parallel.DistributedDataParallel(model, process_group=process_group)
        self.model = model
        self.num_replicas = world_size
        self.engine = "torch DDP" if use_ddp else "torch (no DDP)"
        self.optimizer = spec.make_optimizer(model.parameters())
        data = make_dataset(spec, world_size)
        b, g = spec.batch_size, spec.batch_size * world_size
        x, y = data.tensors
        self._batches = [(x[i * g + rank * b:i * g + (rank + 1) * b], y[i * g + rank * b:i * g + (rank + 1) * b])
                         for i in range(spec.steps_per_epoch)]
        self._it: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(())

    def start_epoch(self) -> None:
        """Begin a fresh pass over the pre-sliced batches."""
        self._it = iter(self._batches)

    def train(self, steps: int) -> None:
        """Run ``steps`` hand-written DDP steps: forward, mean cross-entropy, backward, step, zero_grad."""
        model, optimizer = self.model, self.optimizer
        for _ in range(steps):
            x, y = next(self._it)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


class TowersWorkload(Workload):
    """What a towers user writes: ``scope``, ``prepare``, ``distribute_dataset``, ``run`` with ``compute_average_loss``."""

    def __init__(self, spec: WorkloadSpec, strategy: Any):
        import towers

        self.spec = spec
        self.strategy = strategy
        self.engine = type(strategy).__name__
        self.num_replicas = strategy.num_replicas_in_sync
        with strategy.scope():
            model = spec.make_model()
            optimizer = spec.make_optimizer(model.parameters())
        self.model, self.optimizer = strategy.prepare(model, optimizer)
        n = strategy.num_replicas_in_sync
        dataset = make_dataset(spec, n)
        self.batches = strategy.distribute_dataset(dataset, global_batch_size=n * spec.batch_size, shuffle=False)
        self._compute_average_loss = towers.compute_average_loss
        self._it: Iterator[Any] = iter(())

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = F.cross_entropy(self.model(x), y, reduction="none")
        loss = self._compute_average_loss(per_example)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def start_epoch(self) -> None:
        """Begin a fresh pass over ``strategy.distribute_dataset``."""
        self._it = iter(self.batches)

    def train(self, steps: int) -> None:
        """Run ``steps`` towers steps: next batch from the distributed dataset, then ``strategy.run``."""
        run, step = self.strategy.run, self._step
        for _ in range(steps):
            x, y = next(self._it)
            run(step, args=(x, y))

    def close(self) -> None:
        """Shut the strategy down (idempotent)."""
        self.strategy.shutdown()
