"""The Trainer's evaluate and predict."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Sized, cast

import torch
from torch.utils.data import Dataset

from towers._logging import get_logger
from towers.data import is_stream
from towers.errors import InvalidArgumentError, user_error
from towers.training._steps import as_dataset, per_example
from towers.training._trainer_attributes import TrainerAttributes
from towers.training._trainer_steps import predictions_or, required_labels
from towers.training.batches import call_model, label_count, model_loss, predictions
from towers.training.batches import split as split_batch
from towers.training.callbacks.base import Callback, CallbackList

if TYPE_CHECKING:
    from towers.training.trainer import Trainer

__all__ = ["Inference"]

log = get_logger(__name__)


class Inference(TrainerAttributes):
    """The Trainer's ``evaluate`` and ``predict``.

    A base class of ``Trainer``: its state is the Trainer's.
    """

    def evaluate(self, data: Any, global_batch_size: int | None = None, *,
                 callbacks: Sequence[Callback] = ()) -> dict[str, float]:
        """Return ``{"loss": ..., metric: ...}`` over ``data``, reduced across replicas (the same on every replica)."""
        gbs = global_batch_size
        if gbs is None:
            gbs = self._last_global_batch_size or 32 * self.strategy.num_replicas_in_sync
        if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
            raise InvalidArgumentError(f"global_batch_size must be a positive integer (or None for fit's). Received: {gbs!r}.")
        return self._evaluate(as_dataset(data, "data"), gbs, CallbackList(callbacks, trainer=cast("Trainer", self)))

    def _evaluate(self, dataset: Dataset, global_batch_size: int, cbs: CallbackList) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        metrics = self._val_metrics
        metrics.reset()
        local = torch.zeros(metrics.size + 1, dtype=torch.float64, device=self.strategy.device)  # + examples
        cbs.call("on_test_begin", {})
        with torch.no_grad():
            batches = self.strategy.distribute_dataset(dataset, global_batch_size, shuffle=False, drop_remainder=False)
            for batch_index, batch in enumerate(batches):
                cbs.call("on_test_batch_begin", batch_index, {})
                parts = split_batch(batch, label_key=self.label_key, with_labels_in_inputs=self.loss_fn is None)

                def step(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
                    parts = split_batch(batch, label_key=self.label_key, with_labels_in_inputs=self.loss_fn is None)
                    outputs = call_model(self.model, parts, labels=self._labels_argument)
                    if self.loss_fn is not None:
                        y_pred = predictions(outputs, self.prediction_key)
                        losses = self.loss_fn(y_pred, required_labels(parts, self.label_key)).detach()
                        if losses.dim() == 0:  # a loss that returns its batch's mean: one per label, as in training
                            losses = losses.float().expand(label_count(parts, self.ignore_index)).clone()
                        return losses, y_pred.detach()
                    count = label_count(parts, self.ignore_index, shifted=self._shifted_labels)  # one loss per label
                    mean = model_loss(outputs).detach().float()
                    return mean.expand(count).clone(), predictions_or(outputs, self.prediction_key, mean)

                losses, y_pred = self.strategy.run(step, args=(batch,))
                y = parts.labels if parts.labels is not None else torch.zeros(len(y_pred), device=y_pred.device)
                sums = metrics.local_state(per_example(losses, len(losses)), y_pred, y)  # reduced once, at the end
                local += torch.cat([sums, torch.full((1,), float(parts.size()), dtype=torch.float64, device=sums.device)])
                cbs.call("on_test_batch_end", batch_index, {})
        reduced = self.strategy.reduce("sum", local)
        metrics.accumulate(reduced[:-1])
        logs = metrics.results()
        logs["examples"] = float(reduced[-1].item())
        size = logs["examples"] if is_stream(dataset) else len(cast(Sized, dataset))  # a stream: all it yielded
        if logs["examples"] != size and self.strategy.is_chief:
            warnings.warn(f"evaluate covered {int(logs['examples'])} of the {size} examples: a "
                          "worker died after its share was handed out and before its results were combined. Evaluate "
                          "again for a complete score.", RuntimeWarning, stacklevel=3)
        cbs.call("on_test_end", dict(logs))
        self.model.train(was_training)
        return logs

    def predict(self, x: Any, *, batch_size: int = 256, callbacks: Sequence[Callback] = ()) -> torch.Tensor:
        """Return the model's outputs for ``x`` (a tensor or a dataset of ``(x, ...)`` items), on the CPU.

        Every replica computes all of ``x`` with its own copy of the model (no communication), so
        every replica returns the same tensor.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer. Received: {batch_size!r}.")
        if isinstance(x, Mapping):  # a dict of tensors: the model's keyword arguments (labels left out)
            return self._predict_dicts({k: v for k, v in x.items() if k != self.label_key}, batch_size, callbacks)
        if is_stream(x):
            raise user_error("Trainer.predict takes tensors or a map-style dataset, not a stream",
                             type(x).__name__, "Predict on a tensor of inputs (e.g. torch.stack of the examples), "
                             "or run the model in your own loop over the stream.", cls=TypeError)
        if not isinstance(x, torch.Tensor):
            dataset = as_dataset(x, "x")
            x = torch.stack([dataset[i][0] if isinstance(dataset[i], (tuple, list)) else dataset[i]
                             for i in range(len(cast(Sized, dataset)))])
        cbs = CallbackList(callbacks, trainer=cast("Trainer", self))
        model = self.unwrapped_model
        was_training = model.training
        model.eval()
        outputs = []
        cbs.call("on_predict_begin", {})
        with torch.no_grad():
            for batch_index, start in enumerate(range(0, len(x), batch_size)):
                cbs.call("on_predict_batch_begin", batch_index, {})
                out = predictions(model(x[start:start + batch_size].to(self.strategy.device)),
                                  self.prediction_key).float().cpu()
                outputs.append(out)
                cbs.call("on_predict_batch_end", batch_index, {"outputs": out})
        cbs.call("on_predict_end", {})
        model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)

    def _predict_dicts(self, inputs: Mapping[str, torch.Tensor], batch_size: int,
                       callbacks: Sequence[Callback]) -> torch.Tensor:
        cbs = CallbackList(callbacks, trainer=cast("Trainer", self))
        model = self.unwrapped_model
        was_training = model.training
        model.eval()
        n = len(next(iter(inputs.values())))
        outputs = []
        cbs.call("on_predict_begin", {})
        with torch.no_grad():
            for batch_index, start in enumerate(range(0, n, batch_size)):
                cbs.call("on_predict_batch_begin", batch_index, {})
                chunk = {k: v[start:start + batch_size].to(self.strategy.device) for k, v in inputs.items()}
                out = predictions(model(**chunk), self.prediction_key).float().cpu()
                outputs.append(out)
                cbs.call("on_predict_batch_end", batch_index, {"outputs": out})
        cbs.call("on_predict_end", {})
        model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)

    # --- checkpoints -------------------------------------------------------------------------------
