"""Metrics reduced across replicas with the right weights.

Each metric keeps a small vector of **sums** (for a mean: ``[sum of values, number of examples]``).
After every step the Trainer adds up this step's vectors across replicas with one
``strategy.reduce("sum", ...)`` and the metric accumulates the global sums; ``result()`` divides
once. So a last, uneven batch counts by its examples — never an average of per-replica averages.

``torchmetrics.Metric`` objects (anything with ``update``/``compute``/``reset``) are accepted too.
They update on each replica's own examples; ``compute()``, which the Trainer calls on every
replica at the end of each epoch and of ``evaluate``, gathers their states across replicas
**through the strategy** (``strategy.all_gather_object``), not over torch's default process
group: under parameter servers that group also holds the ps tasks, which never join a metric's
collective, so torchmetrics' own sync would wait forever. Without a strategy they sync as
torchmetrics does by itself. They are left out of per-batch logs (a sync per batch would cost a
collective each), and their state is not part of a checkpoint, so a run resumed mid-epoch
restarts them at that point.
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from towers.errors import InvalidArgumentError, InvalidTypeError

__all__ = [
    "Metric", "Mean", "MeanMetricWrapper", "Accuracy", "SparseCategoricalAccuracy", "TopKAccuracy", "ExternalMetric",
    "accuracy", "top_k_accuracy", "get_metric", "build_metrics",
]


class Metric(ABC):
    """A metric whose state is a vector of sums; ``local_state`` of one batch, ``accumulate`` of reduced sums.

    Subclasses set ``num_states`` and implement ``local_state`` (and ``result``): sums are what replicas
    can add up, so one all-reduce gives the global metric.

    Args:
        name: the name the metric is logged as. Default: the class's name in snake case.

    Raises:
        ValueError: an empty name.
    """

    #: length of the state vector
    num_states: int = 2

    def __init__(self, name: str | None = None):
        name = _snake(type(self).__name__) if name is None else name
        if not name or not isinstance(name, str):
            raise InvalidArgumentError(f"A metric needs a non-empty string name. Received: {name!r}.")
        self.name = name
        self._totals = torch.zeros(self.num_states, dtype=torch.float64)
        self._pending: torch.Tensor | None = None  # update()'s sums on this replica, not yet combined
        self._strategy: Any = None  # the strategy whose replicas result() combines (seen by update())

    @abstractmethod
    def local_state(self, y_pred: torch.Tensor, y_true: torch.Tensor | None = None) -> torch.Tensor:
        """Return this replica's float64 sums for one batch (``[num_states]``, on ``y_pred``'s device)."""

    def accumulate(self, state: torch.Tensor) -> None:
        """Add sums already reduced across replicas."""
        self._totals += state.detach().to("cpu", torch.float64)

    def update(self, y_pred: torch.Tensor, y_true: torch.Tensor | None = None) -> None:
        """Add this replica's batch (in your own loop, inside ``strategy.run``); ``result()`` combines every replica's.

        The TensorFlow pattern: ``train_accuracy.update(logits, labels)`` in the step,
        ``train_accuracy.result()`` after it, on every replica.
        """
        from towers.strategies.base import current_strategy

        with torch.no_grad():
            state = self.local_state(y_pred, y_true).detach()
        self._pending = state if self._pending is None else self._pending + state.to(self._pending.device)
        self._strategy = current_strategy() or self._strategy

    def update_state(self, y_true: torch.Tensor, y_pred: torch.Tensor | None = None) -> None:
        """Keras' argument order: ``update_state(labels, predictions)``, or ``update_state(values)`` for a mean."""
        if y_pred is None:
            self.update(y_true)
        else:
            self.update(y_pred, y_true)

    def result(self) -> float:
        """Return the metric over everything accumulated since ``reset`` (NaN before any example).

        After ``update`` under a strategy of several replicas it is a collective, as in TensorFlow's
        multi-worker training: every replica calls it, and each gets the metric over all replicas'
        examples. To print it once, call it everywhere and print on the chief::

            accuracy = train_accuracy.result()   # every replica
            if strategy.is_chief:
                print(f"accuracy {accuracy:.3f}")

        Raises:
            PartialCollectiveError: (a ``TowersError`` and ``RuntimeError``) only some replicas called it, e.g.
                inside ``if strategy.is_chief:``. Within seconds, on every rank: a replica that went on to
                its next step (or another collective) ends with the same error, naming this call and the
                fix, instead of waiting out a timeout; never a Gloo abort.
        """
        if self._strategy is not None and self._strategy.num_replicas_in_sync > 1:
            from towers.strategies._named import named_collective

            local = self._pending if self._pending is not None else torch.zeros(self.num_states, dtype=torch.float64)
            with named_collective(
                    f"Metric.result() of {self.name!r}",
                    "Call result() on every replica and print on the chief: `value = metric.result()` before "
                    "`if strategy.is_chief: print(value)`."):
                self.accumulate(self._strategy.reduce("sum", local))
        elif self._pending is not None:
            self.accumulate(self._pending)
        self._pending = None
        total, count = self._totals[0].item(), self._totals[1].item()
        return total / count if count else float("nan")

    def reset(self) -> None:
        """Forget everything accumulated (``reset_state``: Keras' name)."""
        self._totals.zero_()
        self._pending = None

    reset_state = reset

    def state_dict(self) -> dict[str, Any]:
        """Return the accumulated sums (checkpoint-safe)."""
        return {"totals": self._totals.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore sums from ``state_dict``."""
        totals = torch.as_tensor(state["totals"], dtype=torch.float64)
        if totals.shape != self._totals.shape:
            raise InvalidArgumentError(f"Metric {self.name!r} expects {self.num_states} sums, received shape "
                                       f"{tuple(totals.shape)}.")
        self._totals = totals.clone()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Mean(Metric):
    """The mean of per-example values, weighted by examples: the Trainer's ``loss``.

    Args:
        name: the name the mean is logged as. Default: ``"mean"``.
    """

    def local_state(self, y_pred: torch.Tensor, y_true: torch.Tensor | None = None) -> torch.Tensor:
        """Return ``[sum, count]`` of the values in ``y_pred`` (one value per example)."""
        values = torch.as_tensor(y_pred).detach().to(torch.float64).reshape(-1)
        # torch.full fills on the device; torch.tensor(..., device=) would copy from the host and wait for the GPU
        return torch.stack([values.sum(), torch.full((), float(values.numel()), dtype=torch.float64,
                                                      device=values.device)])


class MeanMetricWrapper(Mean):
    """The example-weighted mean of ``fn(y_pred, y_true)``, a function returning one value per example.

    Args:
        fn: ``fn(y_pred, y_true)`` returning one value per example.
        name: the name it is logged as. Default: ``fn``'s name.

    Example:
        ```python
        import torch
        from towers.metrics import MeanMetricWrapper

        abs_error = MeanMetricWrapper(lambda y_pred, y_true: (y_pred - y_true).abs().flatten(1).mean(1), name="mae")
        abs_error.update(torch.tensor([[1.0], [2.0]]), torch.tensor([[0.0], [2.0]]))
        assert abs_error.result() == 0.5
        ```
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str | None = None):
        super().__init__(name or str(getattr(fn, "__name__", type(fn).__name__)))
        self.fn = fn

    def local_state(self, y_pred: torch.Tensor, y_true: torch.Tensor | None = None) -> torch.Tensor:
        """Return ``[sum, count]`` of ``fn``'s per-example values on this batch."""
        with torch.no_grad():
            if y_true is None:
                raise InvalidArgumentError(f"Metric {self.name!r} compares predictions with labels. Received: y_true=None. "
                                           "Pass the labels of the batch.")
            return super().local_state(self.fn(y_pred, y_true))


def accuracy(y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
    """Return 1.0/0.0 per example: argmax of logits ``[B, C]`` equals the label; same-shape probabilities use 0.5.

    Args:
        y_pred: logits or probabilities ``[B, C]``, or probabilities shaped like ``y_true`` (binary, at 0.5).
        y_true: the labels: class indices ``[B]``, or 0/1 values shaped like ``y_pred``.

    Returns:
        A float tensor ``[B]``: 1.0 where the prediction is right.
    """
    if y_pred.ndim == y_true.ndim + 1:
        return (y_pred.argmax(dim=-1) == y_true).to(torch.float32)
    if y_pred.shape == y_true.shape:
        return ((y_pred > 0.5).to(y_true.dtype) == y_true).to(torch.float32).reshape(len(y_true), -1).mean(dim=1)
    raise InvalidArgumentError(
        f"accuracy expects logits [B, C] with labels [B], or predictions shaped like the labels. "
        f"Received: y_pred {tuple(y_pred.shape)}, y_true {tuple(y_true.shape)}.")


def top_k_accuracy(y_pred: torch.Tensor, y_true: torch.Tensor, k: int = 5) -> torch.Tensor:
    """Return 1.0/0.0 per example: the label is among the ``k`` largest logits of ``[B, C]``.

    Args:
        y_pred: logits ``[B, C]``.
        y_true: class indices ``[B]``.
        k: how many of the largest logits count.

    Returns:
        A float tensor ``[B]``: 1.0 where the label is among the top ``k``.
    """
    if y_pred.ndim != 2 or y_true.ndim != 1:
        raise InvalidArgumentError(f"top-k accuracy expects logits [B, C] and labels [B]. "
                                   f"Received: y_pred {tuple(y_pred.shape)}, y_true {tuple(y_true.shape)}.")
    top = y_pred.topk(min(k, y_pred.shape[1]), dim=1).indices
    return (top == y_true.unsqueeze(1)).any(dim=1).to(torch.float32)


class Accuracy(MeanMetricWrapper):
    """Fraction of examples whose predicted class (argmax) is the label; logged as ``accuracy``.

    Args:
        name: the name it is logged as.
    """

    def __init__(self, name: str = "accuracy"):
        super().__init__(accuracy, name)


class SparseCategoricalAccuracy(Accuracy):
    """Keras' name for ``Accuracy`` on integer labels (the TensorFlow tutorials' ``train_accuracy``).

    Args:
        name: the name it is logged as.
    """

    def __init__(self, name: str = "sparse_categorical_accuracy"):
        super().__init__(name)


class TopKAccuracy(MeanMetricWrapper):
    """Fraction of examples whose label is among the top ``k`` logits; logged as ``top{k}_accuracy``.

    Args:
        k: how many of the largest logits count.
        name: the name it is logged as. Default: ``top{k}_accuracy``.
    """

    def __init__(self, k: int = 5, name: str | None = None):
        if not isinstance(k, int) or k < 1:
            raise InvalidArgumentError(f"k must be a positive integer. Received: {k!r}.")
        self.k = k
        super().__init__(functools.partial(top_k_accuracy, k=k), name or f"top{k}_accuracy")


class ExternalMetric:
    """Adapter for a ``torchmetrics.Metric`` (or any object with ``update``/``compute``/``reset``).

    Args:
        metric: the ``torchmetrics.Metric`` (or the object with ``update``/``compute``/``reset``).
        name: the name it is logged as. Default: the metric's class name in snake case.
        strategy: the job's strategy; a torchmetrics metric then syncs its states with
            ``strategy.all_gather_object`` (set by ``build_metrics(..., strategy=)``, or ``bind``).
    """

    def __init__(self, metric: Any, name: str | None = None, *, strategy: Any = None):
        self.metric = metric
        self.name = name or _snake(type(metric).__name__)
        self.strategy = None
        if strategy is not None:
            self.bind(strategy)

    def bind(self, strategy: Any) -> "ExternalMetric":
        """Sync the wrapped metric's states through ``strategy`` (every replica must call ``result``); return self."""
        self.strategy = strategy
        for metric in _torchmetrics_parts(self.metric):
            # torchmetrics' own hooks: compute() calls dist_sync_fn(state, group=...) per state tensor,
            # and asks distributed_available_fn() whether to sync at all.
            metric.dist_sync_fn = functools.partial(_gather_through, strategy)
            metric.distributed_available_fn = functools.partial(_several_replicas, strategy)
        return self

    def update(self, y_pred: torch.Tensor, y_true: torch.Tensor) -> None:
        """Update with this replica's batch (local; the states are gathered in ``result``)."""
        if hasattr(self.metric, "to") and hasattr(y_pred, "device"):
            self.metric.to(y_pred.device)
        self.metric.update(y_pred.detach(), y_true)

    def result(self) -> float:
        """Return ``compute()`` as a float; every replica must call it (it is a collective across replicas)."""
        value = self.metric.compute()
        return float(value.item() if hasattr(value, "item") else value)

    def reset(self) -> None:
        """Reset the wrapped metric."""
        self.metric.reset()

    def __deepcopy__(self, memo: dict[int, Any]) -> "ExternalMetric":
        # A copy (e.g. the Trainer's validation metrics) gets its own metric state but the same strategy.
        import copy

        if self.strategy is not None:
            memo[id(self.strategy)] = self.strategy  # the sync hooks refer to it: share, never copy
        twin = ExternalMetric(copy.deepcopy(self.metric, memo), self.name)
        return twin.bind(self.strategy) if self.strategy is not None else twin


def _torchmetrics_parts(metric: Any) -> list[Any]:
    """Return the torchmetrics ``Metric`` objects in ``metric`` (itself, or those of a collection/wrapper)."""
    modules = metric.modules() if callable(getattr(metric, "modules", None)) else [metric]
    return [m for m in modules if hasattr(m, "dist_sync_fn") and hasattr(m, "distributed_available_fn")]


def _gather_through(strategy: Any, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """torchmetrics' ``dist_sync_fn``: every replica's ``tensor``, in replica order, via the strategy."""
    gathered = strategy.all_gather_object(tensor.detach().cpu())
    return [t.to(tensor.device) for t in gathered]


def _several_replicas(strategy: Any) -> bool:
    return strategy.num_replicas_in_sync > 1


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.lstrip("_")).lower()


_TOPK = re.compile(r"^top_?(\d+)_acc(uracy)?$")


def get_metric(spec: Any, *, strategy: Any = None) -> Metric | ExternalMetric:
    """Return a metric for ``spec``: ``"accuracy"``, ``"top5_accuracy"``, a ``Metric``, a torchmetrics metric or a function.

    Args:
        spec: ``"accuracy"``, ``"topK_accuracy"`` (e.g. ``"top5_accuracy"``), a ``Metric``, a torchmetrics metric,
            or a function ``fn(y_pred, y_true)`` returning one value per example.
        strategy: torchmetrics metrics sync through it (see ``ExternalMetric``).

    Returns:
        The metric: ``spec`` itself when it is a ``Metric``, else a new one.

    Raises:
        ValueError: on an unknown metric name, listing the accepted ones.
        TypeError: on an object that is none of the above.
    """
    if isinstance(spec, ExternalMetric):
        return spec.bind(strategy) if strategy is not None else spec
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, str):
        key = spec.lower()
        if key in ("accuracy", "acc", "sparse_categorical_accuracy"):
            return Accuracy(spec if key != "acc" else "accuracy")
        match = _TOPK.match(key)
        if match:
            return TopKAccuracy(int(match.group(1)), name=spec)
        if key == "top_k_accuracy":
            return TopKAccuracy(5, name=spec)
        raise InvalidArgumentError(
            f"Unknown metric {spec!r}. Expected 'accuracy', 'topK_accuracy' (e.g. 'top5_accuracy'), a "
            "towers.metrics.Metric, a torchmetrics.Metric, or a function fn(y_pred, y_true) returning one value "
            "per example.")
    if all(callable(getattr(spec, attr, None)) for attr in ("update", "compute", "reset")):
        return ExternalMetric(spec, strategy=strategy)
    if callable(spec):
        return MeanMetricWrapper(spec)
    raise InvalidTypeError(f"Cannot use {spec!r} ({type(spec).__name__}) as a metric. Pass a name like 'accuracy', "
                           "a towers.metrics.Metric, a torchmetrics.Metric or a per-example function.")


def build_metrics(specs: Iterable[Any] | Mapping[str, Any] | None, *, strategy: Any = None) -> list[Metric | ExternalMetric]:
    """Return metrics for a list of specs (or a ``{name: spec}`` dict); names must be unique and not ``loss``.

    Args:
        specs: what ``get_metric`` takes, in a list, or a ``{name: spec}`` dict that names them; None: none.
        strategy: the job's strategy, through which torchmetrics metrics sync (pass it: under parameter
            servers their own sync would hang).

    Returns:
        The metrics, in order.

    Raises:
        ValueError: two metrics with one name, or a name that is ``loss`` or starts with ``val_``.
    """
    if specs is None:
        return []
    if isinstance(specs, (str, Metric)) or not isinstance(specs, (Mapping, Sequence, set, tuple, list)):
        specs = [specs]
    items = [(name, get_metric(s, strategy=strategy)) for name, s in specs.items()] if isinstance(specs, Mapping) \
        else [(None, get_metric(s, strategy=strategy)) for s in specs]
    metrics = []
    for name, metric in items:
        if name is not None:
            metric.name = str(name)
        metrics.append(metric)
    names = [m.name for m in metrics]
    bad = sorted({n for n in names if names.count(n) > 1 or n == "loss" or n.startswith("val_")})
    if bad:
        raise InvalidArgumentError(f"Metric names must be unique, not 'loss', and not start with 'val_'. Received: {names}. "
                                   "Pass a dict {name: metric} to rename them.")
    return metrics
