"""Batches and model outputs as real models have them: ``(x, y)`` tuples, dicts (Hugging Face), tuples, ``ModelOutput``.

A dict batch is passed to the model as keyword arguments (``model(**batch)``, Hugging Face's
convention); its labels are found by key (``label_key``, default ``"labels"``). For a model that
computes its own loss, an ``(x, y)`` batch's labels go where its forward takes them (``LabelsArgument``):
by position when its second parameter is named like labels (nanoGPT's ``forward(idx, targets)``), else
by name (Hugging Face's ``forward(input_ids, ..., labels=None)``); a forward that takes neither is
refused before the first step. A model's output
may be a tensor, a tuple or list (nanoGPT's ``(logits, loss)``), a dict or a ``ModelOutput``: the
predictions are the ``"logits"`` (or ``prediction_key``: a key or an index), the model's own loss
is ``"loss"`` (a tuple's 0-dim tensor).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from towers.data._batch import host_copy
from towers.errors import InvalidArgumentError, user_error

__all__ = ["BatchParts", "LabelsArgument", "labels_argument", "split", "call_model", "predictions", "model_loss",
           "label_count", "loss_shifts_labels"]

#: Names of a forward's second parameter that takes the labels by position (nanoGPT's ``targets``).
LABEL_NAMES = ("targets", "target", "labels", "label", "y", "y_true")


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


@dataclass(frozen=True)
class LabelsArgument:
    """How a model that computes its own loss takes a batch's labels (see ``labels_argument``)."""

    #: ``model(x, **{keyword: y})`` for an ``(x, y)`` batch; None: ``model(x, y)``.
    keyword: str | None = None
    #: Why an ``(x, y)`` batch cannot be given to the model (the error raised before its first step), or None.
    refusal: str | None = None
    #: The forward takes the labels by the batch's label key: a dict batch without them gives it none.
    by_key: str | None = None


def labels_argument(model: nn.Module, label_key: str = "labels") -> LabelsArgument:
    """Return how ``model.forward`` takes the labels of a batch when the model computes its own loss.

    By position when its second parameter is named like labels (``LABEL_NAMES``: nanoGPT's ``targets``); by
    name when it takes ``label_key`` (Hugging Face's ``labels=``) or ``**kwargs`` (a wrapper hands them on);
    by position when it takes ``*args`` only; otherwise an ``(x, y)`` batch is refused.
    """
    forward = getattr(model, "forward", None)
    try:
        parameters = list(inspect.signature(forward).parameters.values()) if forward is not None else []
    except (TypeError, ValueError):  # a forward without a signature: as before, by position
        return LabelsArgument()
    kinds = inspect.Parameter
    positional = [p for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    named = any(p.name == label_key and p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
                for p in parameters)
    by_key = label_key if named else None
    if len(positional) >= 2 and positional[1].name.lower() in LABEL_NAMES:
        return LabelsArgument(by_key=by_key)
    if named or any(p.kind is kinds.VAR_KEYWORD for p in parameters):  # a wrapper's **kwargs hands them on
        return LabelsArgument(keyword=label_key, by_key=by_key)
    if any(p.kind is kinds.VAR_POSITIONAL for p in parameters):
        return LabelsArgument()
    shown = ", ".join(p.name for p in parameters[:4]) + (", ..." if len(parameters) > 4 else "")
    refusal = user_error(
        f"Trainer(loss=None) trains on the loss the model computes from the labels, but "
        f"{type(model).__name__}.forward({shown}) takes them neither as its second argument (named like "
        f"{', '.join(LABEL_NAMES[:3])}) nor as {label_key}=",
        "(x, y) batches",
        f"Give dict batches whose keys are the forward's argument names (e.g. {{'input_ids': x, '{label_key}': y}}; "
        "Trainer(label_key=...) names the labels' key), or pass a loss, e.g. Trainer(model, optimizer, "
        "loss=F.cross_entropy).")
    return LabelsArgument(refusal=str(refusal))


def call_model(model: nn.Module, parts: BatchParts, *, labels: LabelsArgument | None = None, **extra: Any) -> Any:
    """Return ``model(**inputs)`` for a dict batch, ``model(inputs)`` otherwise; ``extra`` keyword arguments are added.

    A batch split with its labels in the inputs (the model computes its own loss) gives them where ``labels``
    says: ``model(x, y)`` (nanoGPT's ``model(idx, targets)``) or ``model(x, labels=y)`` (Hugging Face's).

    Raises:
        ValueError: an ``(x, y)`` batch for a model that takes no labels, or a dict batch without the labels
            for a model that takes them by name (before the model runs).
    """
    how = labels or LabelsArgument()
    if parts.as_kwargs:
        if parts.labels_in_inputs and parts.labels is None and how.by_key is not None:
            raise user_error(
                f"Trainer(loss=None) trains on the loss {type(model).__name__} computes from {how.by_key!r}, and this "
                "dict batch has none", f"keys {sorted(map(str, parts.inputs))}",
                f"Add the labels to every batch under {how.by_key!r} (a causal LM's labels are its input_ids: the model "
                "shifts them itself, and DataCollatorForLanguageModeling(tokenizer, mlm=False) adds them), name their "
                "key with Trainer(label_key=...), or pass a loss, e.g. Trainer(model, optimizer, "
                "loss=F.cross_entropy).")
        return model(**parts.inputs, **extra)
    if parts.labels_in_inputs and parts.labels is not None:
        if how.refusal is not None:
            raise InvalidArgumentError(how.refusal)
        if how.keyword is not None:
            return model(parts.inputs, **{how.keyword: parts.labels}, **extra)
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
