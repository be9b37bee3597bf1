"""What the benchmark trains: the seed CNN on synthetic images (or the user's model and data), as raw torch DDP
and as towers user code.

Every workload has the same two calls: ``start_epoch()`` (untimed: a fresh pass over the data) and
``train(steps)`` (timed by the runner). Data is generated once, before any timing, and placed on
the replica's device (``cuda:<local rank>`` when every local replica has a GPU, else the CPU); warm-up steps
are run by the runner outside the timed region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from towers.bench.config import LOSSES, OPTIMIZERS
from towers.errors import InvalidArgumentError
from towers.models import SeedCNN

__all__ = ["OPTIMIZERS", "WorkloadSpec", "Workload", "IdleWorkload", "RawTorchWorkload", "TowersWorkload",
           "make_dataset", "replica_device"]


def replica_device(local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """Return the device a benchmark replica uses: ``cuda:<local_rank>`` when every local replica has a GPU, else the CPU.

    The strategies' rule (and ``choose_backend``'s for NCCL): replicas never share a GPU, which NCCL
    refuses, so 2 replicas on a 1-GPU host both run on the CPU, as ``MirroredStrategy`` places them.
    """
    from towers.devices import gpu_count

    return torch.device("cuda", local_rank) if gpu_count() >= local_world_size else torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """The training job every engine runs: model (seed CNN or ``model``), per-replica batch, optimizer, steps per pass.

    ``model``/``dataset``: ``module:factory`` references (see ``towers.bench.user_model``); without
    ``dataset``, inputs are random ``input_shape`` tensors with labels below ``num_classes``
    (``loss="cross_entropy"``) or random targets shaped like the model's output (``loss="mse"``).
    """

    batch_size: int = 64
    steps_per_epoch: int = 35
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    model: str | None = None
    dataset: str | None = None
    input_shape: tuple[int, ...] = (1, 28, 28)
    num_classes: int = 10
    loss: str = "cross_entropy"

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise InvalidArgumentError(f"batch_size (per replica) must be >= 1. Received: {self.batch_size}.")
        if self.steps_per_epoch < 1:
            raise InvalidArgumentError(f"steps_per_epoch must be >= 1. Received: {self.steps_per_epoch}.")
        if self.optimizer not in OPTIMIZERS:
            raise InvalidArgumentError(f"optimizer must be one of {OPTIMIZERS}. Received: {self.optimizer!r}.")
        if self.lr <= 0:
            raise InvalidArgumentError(f"lr must be > 0. Received: {self.lr}.")
        if self.loss not in LOSSES:
            raise InvalidArgumentError(f"loss must be one of {LOSSES}. Received: {self.loss!r}.")
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """Return this spec's optimizer over ``params``."""
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)

    def make_model(self) -> nn.Module:
        """Return a freshly initialised model (same weights for the same seed): the seed CNN or the user's.

        Raises:
            ValueError: when the user's factory fails or returns something other than an ``nn.Module``.
        """
        torch.manual_seed(self.seed)
        if self.model is None:
            return SeedCNN(self.num_classes)
        from towers.bench.user_model import load_factory

        try:
            model = load_factory(self.model, "--model")()
        except ValueError:
            raise
        except Exception as exc:
            raise InvalidArgumentError(f"--model {self.model!r} raised {type(exc).__name__}: {exc}. It is called with no "
                                       "arguments; wrap it in a function that passes yours.") from exc
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"--model {self.model!r} must return a torch.nn.Module. Received: {type(model).__name__}.")
        return model

    def make_raw_dataset(self, n: int) -> Any:
        """Return ``n`` examples: the user's dataset (cycled to ``n``) or random inputs and targets."""
        g = torch.Generator().manual_seed(self.seed)
        if self.dataset is not None:
            from towers.bench.user_model import load_factory

            data = load_factory(self.dataset, "--dataset")()
            try:
                size = len(data)
                x0, _ = data[0]
            except Exception as exc:
                raise InvalidArgumentError(f"--dataset {self.dataset!r} must return a dataset of (input, target) pairs with a "
                                           f"length. Received: {type(data).__name__} ({type(exc).__name__}: {exc}).") from exc
            index = torch.arange(n) % size
            xs = torch.stack([torch.as_tensor(data[int(i)][0]) for i in index[:min(n, size)]])
            ys = torch.stack([torch.as_tensor(data[int(i)][1]) for i in index[:min(n, size)]])
            reps = -(-n // len(xs))
            return torch.utils.data.TensorDataset(xs.repeat(reps, *[1] * (xs.dim() - 1))[:n],
                                                  ys.repeat(reps, *[1] * (ys.dim() - 1))[:n])
        x = torch.rand(n, *self.input_shape, generator=g, device="cpu")
        if self.loss == "cross_entropy":
            y = torch.randint(0, self.num_classes, (n,), generator=g, device="cpu")
        else:
            with torch.no_grad():
                out_shape = self.make_model()(x[:1]).shape[1:]
            y = torch.randn(n, *out_shape, generator=g, device="cpu")
        return torch.utils.data.TensorDataset(x, y)

    def loss_value(self, output: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Return the loss of ``output`` against ``target`` (per example with ``reduction="none"``)."""
        if self.loss == "cross_entropy":
            return F.cross_entropy(output, target, reduction=reduction)
        per_element = F.mse_loss(output, target.to(output.dtype), reduction="none")
        per_example = per_element.reshape(len(per_element), -1).mean(dim=1)
        return per_example if reduction == "none" else per_example.mean()


def make_dataset(spec: WorkloadSpec, num_replicas: int) -> torch.utils.data.TensorDataset:
    """Return the data of one pass: ``steps_per_epoch`` global batches of ``num_replicas * batch_size``."""
    return spec.make_raw_dataset(spec.steps_per_epoch * num_replicas * spec.batch_size)


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

    def next_batch(self) -> Any:
        """Return the next batch of the current pass (the one ``train`` would take next)."""
        raise NotImplementedError


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
                 process_group: Any = None, device: torch.device | None = None):
        self.spec = spec
        use_ddp = world_size > 1 if use_ddp is None else use_ddp
        device = device or torch.device("cpu")
        model = spec.make_model().to(device)
        if use_ddp:
            model = nn.parallel.DistributedDataParallel(
                model, process_group=process_group, device_ids=[device.index] if device.type == "cuda" else None)
        self.model = model
        self.num_replicas = world_size
        self.engine = "torch DDP" if use_ddp else "torch (no DDP)"
        self.optimizer = spec.make_optimizer(model.parameters())
        data = make_dataset(spec, world_size)
        b, g = spec.batch_size, spec.batch_size * world_size
        x, y = (t.to(device) for t in data.tensors)
        self._batches = [(x[i * g + rank * b:i * g + (rank + 1) * b], y[i * g + rank * b:i * g + (rank + 1) * b])
                         for i in range(spec.steps_per_epoch)]
        self._it: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(())

    def start_epoch(self) -> None:
        """Begin a fresh pass over the pre-sliced batches."""
        self._it = iter(self._batches)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the next pre-sliced batch of the current pass."""
        return next(self._it)

    def train(self, steps: int) -> None:
        """Run ``steps`` hand-written DDP steps: forward, mean cross-entropy, backward, step, zero_grad."""
        model, optimizer = self.model, self.optimizer
        for _ in range(steps):
            x, y = next(self._it)
            loss = self.spec.loss_value(model(x), y)
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
        self.compute_average_loss = towers.compute_average_loss  # what the step calls (profile.py too)
        self._it: Iterator[Any] = iter(())

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = self.spec.loss_value(self.model(x), y, reduction="none")
        loss = self.compute_average_loss(per_example)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def start_epoch(self) -> None:
        """Begin a fresh pass over ``strategy.distribute_dataset``."""
        self._it = iter(self.batches)

    def next_batch(self) -> Any:
        """Return the next batch of the current pass over ``strategy.distribute_dataset``."""
        return next(self._it)

    def train(self, steps: int) -> None:
        """Run ``steps`` towers steps: next batch from the distributed dataset, then ``strategy.run``."""
        run, step = self.strategy.run, self._step
        for _ in range(steps):
            x, y = next(self._it)
            run(step, args=(x, y))

    def close(self) -> None:
        """Shut the strategy down (idempotent)."""
        self.strategy.shutdown()
