"""Batches and model outputs as real models have them: ``(x, y)`` tuples, dicts (Hugging Face), tuples, ``ModelOutput``.

A dict batch is passed to the model as keyword arguments (``model(**batch)``, Hugging Face's
convention); its labels are found by key (``label_key``, default ``"labels"``). A model's output
may be a tensor, a tuple or list (nanoGPT's ``(logits, loss)``), a dict or a ``ModelOutput``: the
predictions are the ``"logits"`` (or ``prediction_key``: a key or an index), the model's own loss
is ``"loss"`` (a tuple's 0-dim tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from towers._batch import host_copy
from towers.errors import user_error

__all__ = ["BatchParts", "split", "call_model", "predictions", "model_loss", "label_count", "loss_shifts_labels"]


@dataclass(frozen=True)
class BatchParts:
    """One batch: what the model gets (``inputs``; keyword arguments when ``as_kwargs``) and the labels (or None)."""

    inputs: Any
    labels: torch.Tensor | None
    as_kwargs: bool
    labels_in_inputs: bool = False

    def size(self) -> int:
        """The number of examples (rows) in the batch."""
        if self.labels is not None:
            return len(self.labels)
        first = next(iter(self.inputs.values())) if self.as_kwargs else self.inputs
        return len(first)


def split(batch: Any, *, label_key: str = "labels", with_labels_in_inputs: bool = False) -> BatchParts:
    """Return the parts of a batch: ``(x, y, ...)`` or a dict with ``label_key``.

    ``with_labels_in_inputs``: a dict batch keeps its labels among the model's keyword arguments
    (the model computes its own loss from them).

    Raises:
        ValueError: on a batch that is neither.
    """
    if isinstance(batch, Mapping):
        labels = batch.get(label_key)
        inputs = dict(batch) if with_labels_in_inputs else {k: v for k, v in batch.items() if k != label_key}
        return BatchParts(inputs, labels, True, with_labels_in_inputs)
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return BatchParts(batch[0], batch[1], False, with_labels_in_inputs)
    if isinstance(batch, (tuple, list)) and len(batch) == 1:
        return BatchParts(batch[0], None, False)
    if isinstance(batch, torch.Tensor):
        return BatchParts(batch, None, False)
    raise user_error("Each batch must be (x, y), a tensor, or a dict of tensors (passed to the model as keyword "
                     "arguments)", type(batch).__name__,
                     "Use TensorDataset(x, y), a dataset of dicts, or a dict of tensors such as {'input_ids': ..., "
                     "'labels': ...}.")


def call_model(model: nn.Module, parts: BatchParts, **extra: Any) -> Any:
    """Return ``model(**inputs)`` for a dict batch, ``model(inputs)`` otherwise (``model(x, y)`` for a batch split
    with its labels in the inputs: nanoGPT's ``model(idx, targets)``); ``extra`` keyword arguments are added."""
    if parts.as_kwargs:
        return model(**parts.inputs, **extra)
    if parts.labels_in_inputs and parts.labels is not None:
        return model(parts.inputs, parts.labels, **extra)
    return model(parts.inputs, **extra)


def predictions(outputs: Any, key: str | int | None = None) -> torch.Tensor:
    """Return the predictions in a model's ``outputs`` (``"logits"`` or ``key``).

    Raises:
        ValueError: when there is nothing at ``key``, or no tensor of predictions.
    """
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):  # dicts and Hugging Face's ModelOutput
        wanted = "logits" if key is None else key
        if wanted not in outputs:
            raise user_error(f"The model's output has no {wanted!r}", sorted(map(str, outputs)),
                             "Pass Trainer(prediction_key=...) naming the entry that holds the predictions.")
        return outputs[wanted]
    if isinstance(outputs, (tuple, list)):
        if isinstance(key, int):
            return outputs[key]
        for item in outputs:  # nanoGPT's (logits, loss) and Hugging Face's (loss, logits, ...): the first non-scalar
            if isinstance(item, torch.Tensor) and item.dim() > 0:
                return item
    raise user_error("The model's output holds no tensor of predictions", type(outputs).__name__,
                     "Return a tensor, a tuple, a dict or a ModelOutput with 'logits', or pass Trainer(prediction_key=...).")


def model_loss(outputs: Any) -> torch.Tensor:
    """Return the loss a model computed itself (``"loss"`` of a dict/``ModelOutput``, a tuple's 0-dim tensor).

    Raises:
        ValueError: when the output holds none (the model was not given its labels, or computes no loss).
    """
    if isinstance(outputs, Mapping) and outputs.get("loss") is not None:
        return outputs["loss"]
    if isinstance(outputs, (tuple, list)):
        for item in outputs:
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                return item
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    raise user_error("Trainer(loss=None) trains on the loss the model returns, but its output holds none",
                     type(outputs).__name__ if not isinstance(outputs, Mapping) else sorted(map(str, outputs)),
                     "Give the model its labels (a dict batch with 'labels', or label_key=...), or pass loss=, e.g. "
                     "Trainer(model, optimizer, loss=F.cross_entropy).")


def loss_shifts_labels(model: nn.Module) -> bool:
    """True when ``model``'s own loss shifts its labels (a Hugging Face causal LM: position i predicts label i+1).

    Its mean then counts the labels of ``labels[..., 1:]`` only, as Hugging Face's own Trainer counts
    them: a decoder whose loss is ``ForCausalLMLoss`` and that is not an encoder-decoder (those feed
    right-shifted decoder inputs and predict every label). Read from the model's ``loss_function``
    by name, so transformers need not be imported.
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        loss_function = getattr(model, "loss_function", None)
    except Exception:  # a property that fails on an unusual model: no shift known
        return False
    return getattr(loss_function, "__name__", "") == "ForCausalLMLoss"


def label_count(parts: BatchParts, ignore_index: int, *, shifted: bool = False) -> int:
    """The number of labels the model's mean loss averages over: label entries other than ``ignore_index``.

    ``shifted``: the model's loss shifts its labels (``loss_shifts_labels``), so the first label of each
    row is never predicted and is not counted (a batch's ``shift_labels``, when it has them, are counted
    instead, as Hugging Face's Trainer does). Counted on the labels' host copy where the batch was moved
    to a device (a GPU's work queue is not waited for).
    """
    labels = parts.labels
    if labels is None or not isinstance(labels, torch.Tensor):
        return parts.size()
    if shifted:
        given = parts.inputs.get("shift_labels") if parts.as_kwargs else None
        if isinstance(given, torch.Tensor):
            labels = given
        else:
            host = host_copy(labels)
            labels = (labels if host is None else host)[..., 1:]
    host = host_copy(labels)
    return int((labels if host is None else host).ne(ignore_index).sum())
