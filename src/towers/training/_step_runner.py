"""The Trainer's training step: the loss as given or the model's own, the update, and this replica's metric sums."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from towers.data import BatchInfo
from towers.data._batch import whole
from towers.errors import InvalidArgumentError, user_error
from towers.training._steps import MetricSet, per_example
from towers.training.batches import (
    BatchParts,
    LabelsArgument,
    call_model,
    label_count,
    labels_argument,
    loss_shifts_labels,
    model_loss,
    predictions,
)
from towers.training.batches import split as split_batch

if TYPE_CHECKING:
    from towers.training.trainer import Trainer

__all__ = ["ModelLabels", "StepRunner", "required_labels", "predictions_or"]


@dataclass(frozen=True)
class ModelLabels:
    """How the model's own loss (``Trainer(loss=None)``) takes and counts a batch's labels, read once from the model.

    With a ``loss`` given: none of this (the Trainer hands the labels to the loss itself).
    """

    #: Where an ``(x, y)`` batch's labels go: ``model(x, y)`` or ``model(x, labels=y)`` (Hugging Face).
    argument: LabelsArgument = field(default_factory=LabelsArgument)
    #: A causal LM's own loss predicts label i+1 from position i: it counts ``labels[..., 1:]``, and so does the Trainer.
    shifted: bool = False
    #: The model takes ``num_items_in_batch`` (Hugging Face's): it is given the batch's label count.
    passes_count: bool = False

    @classmethod
    def of(cls, model: nn.Module, loss: Any, label_key: str) -> ModelLabels:
        """Read them from ``model`` (``Trainer(model, loss=loss, label_key=label_key)``)."""
        if loss is not None:
            return cls()
        passes_count = _takes(model, "num_items_in_batch")
        shifted = loss_shifts_labels(model)
        return cls(argument=labels_argument(model, label_key), shifted=shifted, passes_count=passes_count)


class StepRunner:
    """Runs one training step of ``trainer``: forward and backward under its strategy, then the update.

    Reads the trainer's public settings as they are at each step (``strategy``, ``model``, ``optimizer``,
    ``loss_fn``, ``label_key``, ``prediction_key``, ``ignore_index``, ``clip_grad_norm``); is handed how the
    model's own loss takes its labels (``labels``) and the training metrics it sums a step into (``metrics``).
    """

    def __init__(self, trainer: Trainer, labels: ModelLabels, metrics: MetricSet):
        self.trainer = trainer
        self.labels = labels
        self.metrics = metrics

    def run(self, batch: Any, info: BatchInfo | None) -> tuple[int, torch.Tensor]:
        """Run one step on ``batch`` (carrying ``info``); return the step's global batch size and this replica's
        metric sums of it, on the device (nothing here waits for it)."""
        t = self.trainer
        parts = outer = split_batch(batch, label_key=t.label_key, with_labels_in_inputs=t.loss_fn is None)
        y = parts.labels
        from towers.losses import compute_average_loss

        def step(given: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            # run passes the batch it was given (it reads its accounting from its tensors): split once per step
            parts = outer if given is batch else split_batch(given, label_key=t.label_key,
                                                             with_labels_in_inputs=t.loss_fn is None)
            if t.loss_fn is None:
                return self._own_loss_step(parts)
            kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (losses, predictions) of each call of loss_of

            def loss_of(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
                # Called once here, or once per micro-batch where the strategy cuts the batch (a pipeline's last stage).
                y_pred = predictions(outputs, t.prediction_key)
                per_example = t.loss_fn(y_pred, labels)
                if per_example.dim() == 0:  # a loss that returns its batch's mean: one device's mean over the labels
                    count = label_count(replace(parts, labels=labels), t.ignore_index)
                    loss, shown = _normalised_mean(per_example, count, outputs)
                    kept.append((whole(shown).expand(count).clone(), whole(y_pred.detach())))
                    return loss
                kept.append((whole(per_example.detach()), whole(y_pred.detach())))  # split logits (loss parallel): whole
                return compute_average_loss(per_example)  # strategy.backward scales it under fp16

            inputs = parts.inputs if parts.as_kwargs else (parts.inputs,)  # the prepared model applies its precision
            t.strategy.forward_backward(t.model, inputs, required_labels(parts, t.label_key), loss_of)
            self._update()
            if not kept:  # this process computed no loss (a pipeline's earlier stages): the strategy's reduce brings it
                return None, None
            if len(kept) == 1:
                return kept[0]
            return torch.cat([k[0] for k in kept]), torch.cat([k[1] for k in kept])

        try:  # the batch as distribute_dataset yielded it: run reads its accounting from its tensors
            losses, y_pred = t.strategy.run(step, args=(batch,))
        except RuntimeError as exc:
            if "cannot be multiplied" not in str(exc) and "size mismatch" not in str(exc):
                raise
            x = parts.inputs
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InvalidArgumentError(
                f"The model cannot take this batch: its input has shape {shape} (batch first), and torch says: "
                f"{str(exc).splitlines()[0]}. Make the data's feature shape match the model's first layer (e.g. "
                "nn.Linear(in_features=...) equal to the last dimension of x), or reshape/flatten x.") from exc
        if losses is None or y_pred is None:  # sums of zeros, which the reduction replaces by the last stage's
            local = torch.zeros(self.metrics.size + 1, dtype=torch.float64, device=t.strategy.device)
        else:
            if y is None:
                y = torch.zeros(len(y_pred), device=y_pred.device)  # no labels: only the loss is a metric then
            losses = per_example(losses, len(losses))
            local = self.metrics.local_state(losses, y_pred, y, with_nonfinite=True)
        size = info.global_batch_size if info is not None else parts.size() * t.strategy.num_replicas_in_sync
        return size, local

    def _update(self) -> None:
        t = self.trainer
        if t.clip_grad_norm is not None:  # once per update, on the complete gradient
            t.strategy.clip_grad_norm_(t.model.parameters(), t.clip_grad_norm)
        t.optimizer.step()  # the prepared optimizer: all-reduced, accumulated or pushed to servers
        t.optimizer.zero_grad(set_to_none=True)

    def _own_loss_step(self, parts: BatchParts) -> tuple[torch.Tensor, torch.Tensor]:
        """A step on the model's own (token-mean) loss, normalised by the update's global label count."""
        t, labels = self.trainer, self.labels
        count = label_count(parts, t.ignore_index, shifted=labels.shifted)
        # The model's loss is its mean over this batch's labels; times their count it is their sum. A model that
        # takes num_items_in_batch (Hugging Face's) divides its sum by exactly that count, so the product is its
        # sum of token losses whatever tokens it counts (a causal LM shifts its labels).
        extra = {"num_items_in_batch": max(count, 1)} if labels.passes_count else {}
        outputs = call_model(t.model, parts, labels=labels.argument, **extra)
        shown = self._backward_mean(model_loss(outputs), count, outputs)
        return shown.expand(count).clone(), predictions_or(outputs, t.prediction_key, shown)

    def _backward_mean(self, mean: torch.Tensor, count: int, outputs: Any) -> torch.Tensor:
        """Backpropagate a loss that is the mean over ``count`` labels, normalised by the update's global label count.

        Returns the mean, detached (one loss per label: the loss metric is label-weighted)."""
        loss, shown = _normalised_mean(mean, count, outputs)
        self.trainer.strategy.backward(loss)
        self._update()
        return shown


def _normalised_mean(mean: torch.Tensor, count: int, outputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(loss to backpropagate, mean detached)`` for a loss that is the mean over ``count`` labels."""
    from towers.losses import compute_average_loss

    if count == 0:  # no label here (an empty share): a zero gradient, not the NaN of a mean over nothing
        mean = _zero_loss(outputs, mean)
    # The strategy divides the update's gradient by the label count over every replica and micro-batch.
    # The count lives on the host (compute_average_loss reads it there, without waiting for the device).
    weights = torch.full((1,), float(count), device="cpu")
    return compute_average_loss(mean.reshape(1), weights=weights), mean.detach().float()


def required_labels(parts: BatchParts, label_key: str) -> torch.Tensor:
    """The batch's labels, for ``Trainer(loss=...)``; raise the fix when it has none."""
    if parts.labels is None:
        raise user_error("Trainer(loss=...) compares the predictions with the batch's labels, but this batch has none",
                         f"a {'dict without ' + repr(label_key) if parts.as_kwargs else 'batch without a second item'}",
                         "Give batches as (x, y) or dicts with the labels under label_key, or pass loss=None to train "
                         "on the loss the model returns.")
    return parts.labels


def _zero_loss(outputs: Any, loss: torch.Tensor) -> torch.Tensor:
    """A zero loss connected to the model's outputs (its gradient is zero, never NaN)."""
    try:
        return predictions(outputs, None).sum() * 0.0
    except ValueError:
        return torch.nan_to_num(loss, nan=0.0) * 0.0


def predictions_or(outputs: Any, key: str | int | None, fallback: torch.Tensor) -> torch.Tensor:
    """The model's predictions, or ``fallback`` when its output holds none (a model returning only its loss)."""
    try:
        return predictions(outputs, key).detach()
    except ValueError:
        return fallback.reshape(1)


def _takes(model: nn.Module, name: str) -> bool:
    """True when ``model.forward`` takes ``name`` (Hugging Face's ``num_items_in_batch``: named, or through the
    ``**kwargs`` a transformers model hands its ``loss_function``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if name in parameters:
        return True
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return var_keyword and hasattr(type(model), "loss_function")
