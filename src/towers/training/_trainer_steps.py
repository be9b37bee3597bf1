"""The Trainer's training step: the loss as given or the model's own, the update, and the metrics reduced across replicas."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Mapping

import torch

from towers._logging import get_logger
from towers.data import BatchInfo
from towers.data._batch import whole
from towers.errors import InvalidArgumentError, user_error
from towers.strategies.base import PeerLostError
from towers.training._steps import per_example
from towers.training._trainer_attributes import TrainerAttributes
from towers.training.batches import BatchParts, call_model, label_count, model_loss, predictions
from towers.training.batches import split as split_batch

__all__ = ["TrainingSteps", "required_labels", "predictions_or"]

log = get_logger(__name__)


class TrainingSteps(TrainerAttributes):
    """The Trainer's training step and the training metrics reduced across replicas.

    A base class of ``Trainer``: its state is the Trainer's.
    """

    def _train_step(self, batch: Any, info: BatchInfo | None) -> tuple[int, torch.Tensor]:
        """Run one step on ``batch`` (carrying ``info``); return the step's global batch size and this replica's
        metric sums of it, on the device (nothing here waits for it)."""
        parts = outer = split_batch(batch, label_key=self.label_key, with_labels_in_inputs=self.loss_fn is None)
        y = parts.labels
        from towers.losses import compute_average_loss

        def step(given: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            # run passes the batch it was given (it reads its accounting from its tensors): split once per step
            parts = outer if given is batch else split_batch(given, label_key=self.label_key,
                                                             with_labels_in_inputs=self.loss_fn is None)
            if self.loss_fn is None:
                return self._own_loss_step(parts)
            kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (losses, predictions) of each call of loss_of

            def loss_of(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
                # Called once here, or once per micro-batch where the strategy cuts the batch (a pipeline's last stage).
                y_pred = predictions(outputs, self.prediction_key)
                per_example = self.loss_fn(y_pred, labels)
                if per_example.dim() == 0:  # a loss that returns its batch's mean: one device's mean over the labels
                    count = label_count(replace(parts, labels=labels), self.ignore_index)
                    loss, shown = self._normalised_mean(per_example, count, outputs)
                    kept.append((whole(shown).expand(count).clone(), whole(y_pred.detach())))
                    return loss
                kept.append((whole(per_example.detach()), whole(y_pred.detach())))  # split logits (loss parallel): whole
                return compute_average_loss(per_example)  # strategy.backward scales it under fp16

            inputs = parts.inputs if parts.as_kwargs else (parts.inputs,)  # the prepared model applies its precision
            self.strategy.forward_backward(self.model, inputs, required_labels(parts, self.label_key), loss_of)
            self._update()
            if not kept:  # this process computed no loss (a pipeline's earlier stages): the strategy's reduce brings it
                return None, None
            if len(kept) == 1:
                return kept[0]
            return torch.cat([k[0] for k in kept]), torch.cat([k[1] for k in kept])

        try:  # the batch as distribute_dataset yielded it: run reads its accounting from its tensors
            losses, y_pred = self.strategy.run(step, args=(batch,))
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
            local = torch.zeros(self._train_metrics.size + 1, dtype=torch.float64, device=self.strategy.device)
        else:
            if y is None:
                y = torch.zeros(len(y_pred), device=y_pred.device)  # no labels: only the loss is a metric then
            losses = per_example(losses, len(losses))
            local = self._train_metrics.local_state(losses, y_pred, y, with_nonfinite=True)
        self.step_batch_info = info
        size = info.global_batch_size if info is not None else parts.size() * self.strategy.num_replicas_in_sync
        return size, local

    def _update(self) -> None:
        if self.clip_grad_norm is not None:  # once per update, on the complete gradient
            self.strategy.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.optimizer.step()  # the prepared optimizer: all-reduced, accumulated or pushed to servers
        self.optimizer.zero_grad(set_to_none=True)

    def _own_loss_step(self, parts: BatchParts) -> tuple[torch.Tensor, torch.Tensor]:
        """A step on the model's own (token-mean) loss, normalised by the update's global label count."""
        count = label_count(parts, self.ignore_index, shifted=self._shifted_labels)
        # The model's loss is its mean over this batch's labels; times their count it is their sum. A model that
        # takes num_items_in_batch (Hugging Face's) divides its sum by exactly that count, so the product is its
        # sum of token losses whatever tokens it counts (a causal LM shifts its labels).
        extra = {"num_items_in_batch": max(count, 1)} if self._passes_count else {}
        outputs = call_model(self.model, parts, labels=self._labels_argument, **extra)
        shown = self._backward_mean(model_loss(outputs), count, outputs)
        return shown.expand(count).clone(), predictions_or(outputs, self.prediction_key, shown)

    def _backward_mean(self, mean: torch.Tensor, count: int, outputs: Any) -> torch.Tensor:
        """Backpropagate a loss that is the mean over ``count`` labels, normalised by the update's global label count.

        Returns the mean, detached (one loss per label: the loss metric is label-weighted)."""
        loss, shown = self._normalised_mean(mean, count, outputs)
        self.strategy.backward(loss)
        self._update()
        return shown

    def _normalised_mean(self, mean: torch.Tensor, count: int, outputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(loss to backpropagate, mean detached)`` for a loss that is the mean over ``count`` labels."""
        from towers.losses import compute_average_loss

        if count == 0:  # no label here (an empty share): a zero gradient, not the NaN of a mean over nothing
            mean = _zero_loss(outputs, mean)
        # The strategy divides the update's gradient by the label count over every replica and micro-batch.
        # The count lives on the host (compute_average_loss reads it there, without waiting for the device).
        weights = torch.full((1,), float(count), device="cpu")
        return compute_average_loss(mean.reshape(1), weights=weights), mean.detach().float()

    def _warn_nonfinite(self, logs: Mapping[str, Any]) -> None:
        """Warn once, on the chief, when a loss was not finite and no callback stopped training for it."""
        if self._nonfinite_warning != "due":
            return
        self._nonfinite_warning = "said"  # once per Trainer; every replica saw the same reduced value
        if self.strategy.is_chief and not self.stop_training:
            warnings.warn(
                f"The training loss is not finite (NaN or inf) on {int(logs.get('nonfinite_replicas', 0))} "
                "replica-step(s) reduced at this step; training goes on with it. Add "
                "towers.callbacks.TerminateOnNaN() to fit's callbacks to stop, or lower the learning rate / check the "
                "data.", RuntimeWarning, stacklevel=3)

    def _warn_no_labels(self) -> None:
        """Warn once, on the chief, that the batches reduced now had no label token (every replica decided alike)."""
        if self._said_no_labels:
            return
        self._said_no_labels = True
        if self.strategy.is_chief:
            warnings.warn(
                f"The training batches reduced at global step {self.progress.global_step} had no label token: every "
                f"label equals ignore_index={self.ignore_index} on every replica, so their loss is a mean over nothing "
                "(NaN in the logs while no batch of the epoch had a label) and they teach the model nothing. Check "
                "how the batches are labelled: the collator (e.g. DataCollatorForLanguageModeling(tokenizer, "
                "mlm=False) copies input_ids into labels), a prompt mask that covers whole sequences, truncation that "
                "cuts off every answer; or pass Trainer(ignore_index=...) as your labels mark padding.",
                RuntimeWarning, stacklevel=4)

    def _sync_train_metrics(self) -> dict[str, float]:
        """Reduce the metric sums kept since the last call (one collective); return the logs through this step.

        When a peer was lost since the step began (``PeerLostError``, fault-tolerant strategies), the logs
        stay those of the last synchronisation and this replica keeps its sums for the next one of the
        epoch (at the epoch's end there is none: its logs then cover the steps up to the last one).
        """
        if self._unsynced is not None:
            try:
                reduced = self.strategy.reduce("sum", self._unsynced).detach().to("cpu", torch.float64)
            except PeerLostError as exc:
                log.warning("training metrics not reduced at global step %d (%s); the logs keep the values of the "
                            "last reduction, and this replica's sums since are added at the next one of this epoch",
                            self.progress.global_step, str(exc).splitlines()[0])
                return dict(self._last_train_logs)
            self._unsynced = None
            self._train_metrics.accumulate(reduced)
            nonfinite, label_count = float(reduced[-1]), float(reduced[1])  # on the host already: no wait
            self._last_train_logs = {**self._train_metrics.results(external=False), "nonfinite_replicas": nonfinite}
            if nonfinite > 0 and self._nonfinite_warning == "unseen":
                self._nonfinite_warning = "due"  # said after the callbacks, unless one of them stops training
            if label_count == 0:  # the loss's count: no label token in any batch since the last reduction
                self._warn_no_labels()
        return dict(self._last_train_logs)

    def _any_replica(self, flag: bool) -> bool:
        """True when ``flag`` is set on any replica: a callback may decide on one replica only, and stopping must
        still be a global decision. When a peer was lost since the step began (``PeerLostError``), nobody
        decides now: False, and this replica's flag joins the next reduction."""
        flag = flag or self._stop_pending
        try:
            decided = self.strategy.reduce("max", torch.tensor([float(flag)], device=self.strategy.device))
        except PeerLostError as exc:
            if flag:
                log.warning("stop_training not decided at global step %d (%s): it is at the next reduction",
                            self.progress.global_step, str(exc).splitlines()[0])
            self._stop_pending = flag
            return False
        self._stop_pending = False
        return bool(decided.item() > 0)

    # --- evaluate and predict ----------------------------------------------------------------------


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
