"""Pieces of the Trainer's steps: the per-example loss, inputs as datasets, batches, and metric sums."""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from towers.data import TensorDictDataset, is_stream
from towers.errors import InvalidArgumentError, InvalidTypeError
from towers.training.metrics import ExternalMetric, Mean, Metric

__all__ = ["per_example_loss_fn", "as_dataset", "split_batch", "MetricSet"]


def per_example_loss_fn(loss: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Return ``fn(y_pred, y_true) -> per-example losses`` for a function or an ``nn`` loss module."""
    if isinstance(loss, nn.Module) and hasattr(loss, "reduction"):
        module = copy.copy(loss)
        setattr(module, "reduction", "none")  # noqa: B010 (the Trainer averages over the global batch itself)
        return module
    if callable(loss):
        if not _takes_reduction(loss):  # the loss reduces itself (a mean): the Trainer weighs it by its labels
            return loss
        return lambda y_pred, y_true: loss(y_pred, y_true, reduction="none")
    raise InvalidTypeError(f"loss must be a callable like torch.nn.functional.cross_entropy. Received: {loss!r}.")


def _takes_reduction(fn: Callable[..., Any]) -> bool:
    """True when ``fn`` takes ``reduction=`` (torch's losses), named or through ``**kwargs``."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume torch's convention
        return True
    return "reduction" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def as_dataset(data: Any, what: str) -> Dataset:
    """Return ``data`` as a map-style dataset (a tuple ``(x, y)`` of tensors becomes a ``TensorDataset``)."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        if len(data[0]) != len(data[1]):
            raise InvalidArgumentError(f"{what}: x and y must have the same length. Received: {len(data[0])} and {len(data[1])}.")
        return TensorDataset(data[0], data[1])
    if isinstance(data, Mapping):  # {"input_ids": ..., "attention_mask": ..., "labels": ...}
        try:
            return TensorDictDataset(data)
        except ValueError as exc:
            raise InvalidArgumentError(f"{what}: {exc}") from None
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return data
    if is_stream(data):  # towers.data.Shards, a torch IterableDataset, a Hugging Face stream
        return data
    raise InvalidTypeError(f"{what} must be a map-style Dataset (e.g. TensorDataset), a tuple (x, y) of tensors, a dict of "
                           "tensors, or a stream (towers.data.Shards, a torch IterableDataset). "
                           f"Received: {type(data).__name__}.")


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, y)`` of a batch; extra items are ignored."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise InvalidArgumentError(f"Each batch must be (x, y). Received: {type(batch).__name__}"
                               f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. "
                               "Use a dataset whose items are (input, label) pairs, e.g. TensorDataset(x, y).")


def per_example(values: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Return one loss per example: ``values`` with extra dimensions (e.g. per pixel) averaged."""
    if values.ndim == 0 and batch_size > 0:
        raise InvalidArgumentError(f"loss must return one value per example when called with reduction='none'; it returned "
                                   f"a scalar for a batch of {batch_size}. Pass e.g. F.cross_entropy, or a function that "
                                   "accepts reduction=.")
    return values.reshape(batch_size, -1).mean(dim=1) if values.ndim > 1 else values


class MetricSet:
    """``loss`` plus the user's metrics: one vector of local sums per batch, accumulated once reduced."""

    def __init__(self, metrics: Sequence[Metric | ExternalMetric]):
        self.loss = Mean("loss")
        self.metrics = list(metrics)
        self.summed = [m for m in self.metrics if isinstance(m, Metric)]
        self.size = 2 + sum(m.num_states for m in self.summed)

    def reset(self) -> None:
        """Forget every accumulated value."""
        for m in (self.loss, *self.metrics):
            m.reset()

    def local_state(self, losses: torch.Tensor, y_pred: torch.Tensor, y: torch.Tensor, *,
                    with_nonfinite: bool = False) -> torch.Tensor:
        """Return this replica's float64 sums for a batch (and update torchmetrics-style metrics locally).

        ``with_nonfinite``: one more value, 1.0 when a loss of the batch is not finite (NaN or inf), else 0.0.
        Every value is computed on the device, queued: nothing here waits for it.
        """
        for m in self.metrics:
            if isinstance(m, ExternalMetric):
                m.update(y_pred, y)
        loss = self.loss.local_state(losses)
        pieces = [loss, *(m.local_state(y_pred.float(), y) for m in self.summed)]
        if with_nonfinite:
            pieces.append(_nonfinite(losses, loss))
        return torch.cat(pieces)

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Add sums already reduced across replicas (the first ``self.size`` values of ``reduced``)."""
        reduced = reduced.detach().to("cpu", torch.float64)
        self.loss.accumulate(reduced[0:2])
        offset = 2
        for m in self.summed:
            m.accumulate(reduced[offset:offset + m.num_states])
            offset += m.num_states

    def results(self, *, external: bool = True) -> dict[str, float]:
        """Return ``{"loss": ..., name: ...}``; ``external`` includes torchmetrics (their ``compute`` may be a collective)."""
        chosen = self.metrics if external else self.summed
        return {"loss": self.loss.result(), **{m.name: m.result() for m in chosen}}

    def examples(self) -> float:
        """Return how many examples the accumulated sums cover."""
        return float(self.loss.state_dict()["totals"][1].item())

    def all(self) -> list[Metric | ExternalMetric]:
        """Return the loss metric and every user metric."""
        return [self.loss, *self.metrics]


def _nonfinite(losses: torch.Tensor, loss_state: torch.Tensor) -> torch.Tensor:
    """``[1.0]`` when a value of ``losses`` is NaN or inf, else ``[0.0]`` (float64, on their device).

    Below float64, read off the float64 sum ``loss_state[0]`` (3 small operations instead of 5): it is finite exactly
    when every loss is (no sum of float32 or narrower values overflows float64), and ``sum * 0`` is 0 or NaN.
    """
    if losses.dtype == torch.float64:  # a float64 sum of finite values may overflow: look at the values
        return (~torch.isfinite(losses)).any().to(torch.float64).reshape(1)
    return torch.nan_to_num(loss_state[:1] * 0.0, nan=1.0)
