"""The Trainer's evaluate and predict: the model run without updates, over a dataset or over inputs."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Sized, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from towers.data import is_stream
from towers.errors import user_error
from towers.training._step_runner import ModelLabels, predictions_or, required_labels
from towers.training._steps import MetricSet, as_dataset, per_example
from towers.training.batches import call_model, label_count, model_loss, predictions
from towers.training.batches import split as split_batch
from towers.training.callbacks.base import Callback, CallbackList

if TYPE_CHECKING:
    from towers.training.trainer import Trainer

__all__ = ["Inference"]


class Inference:
    """Evaluates and predicts with ``trainer``'s model (``Trainer.evaluate``, ``Trainer.predict``, fit's validation).

    Reads the trainer's public settings as they are at each call (``strategy``, ``model``, ``loss_fn``,
    ``label_key``, ``prediction_key``, ``ignore_index``); is handed how the model's own loss takes its labels
    (``labels``) and the validation metrics it computes (``metrics``, its own: the training ones keep their sums).
    """

    def __init__(self, trainer: Trainer, labels: ModelLabels, metrics: MetricSet):
        self.trainer = trainer
        self.labels = labels
        self.metrics = metrics

    def evaluate(self, dataset: Dataset, global_batch_size: int, cbs: CallbackList) -> dict[str, float]:
        """Return ``{"loss": ..., metric: ...}`` over ``dataset``, reduced across replicas."""
        t, own = self.trainer, self.labels
        was_training = t.model.training
        t.model.eval()
        metrics = self.metrics
        metrics.reset()
        local = torch.zeros(metrics.size + 1, dtype=torch.float64, device=t.strategy.device)  # + examples
        cbs.call("on_test_begin", {})
        with torch.no_grad():
            batches = t.strategy.distribute_dataset(dataset, global_batch_size, shuffle=False, drop_remainder=False)
            for batch_index, batch in enumerate(batches):
                cbs.call("on_test_batch_begin", batch_index, {})
                parts = split_batch(batch, label_key=t.label_key, with_labels_in_inputs=t.loss_fn is None)

                def step(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
                    parts = split_batch(batch, label_key=t.label_key, with_labels_in_inputs=t.loss_fn is None)
                    outputs = call_model(t.model, parts, labels=own.argument)
                    if t.loss_fn is not None:
                        y_pred = predictions(outputs, t.prediction_key)
                        losses = t.loss_fn(y_pred, required_labels(parts, t.label_key)).detach()
                        if losses.dim() == 0:  # a loss that returns its batch's mean: one per label, as in training
                            losses = losses.float().expand(label_count(parts, t.ignore_index)).clone()
                        return losses, y_pred.detach()
                    count = label_count(parts, t.ignore_index, shifted=own.shifted)  # one loss per label
                    mean = model_loss(outputs).detach().float()
                    return mean.expand(count).clone(), predictions_or(outputs, t.prediction_key, mean)

                losses, y_pred = t.strategy.run(step, args=(batch,))
                y = parts.labels if parts.labels is not None else torch.zeros(len(y_pred), device=y_pred.device)
                sums = metrics.local_state(per_example(losses, len(losses)), y_pred, y)  # reduced once, at the end
                local += torch.cat([sums, torch.full((1,), float(parts.size()), dtype=torch.float64, device=sums.device)])
                cbs.call("on_test_batch_end", batch_index, {})
        reduced = t.strategy.reduce("sum", local)
        metrics.accumulate(reduced[:-1])
        logs = metrics.results()
        logs["examples"] = float(reduced[-1].item())
        size = logs["examples"] if is_stream(dataset) else len(cast(Sized, dataset))  # a stream: all it yielded
        if logs["examples"] != size and t.strategy.is_chief:
            warnings.warn(f"evaluate covered {int(logs['examples'])} of the {size} examples: a "
                          "worker died after its share was handed out and before its results were combined. Evaluate "
                          "again for a complete score.", RuntimeWarning, stacklevel=3)
        cbs.call("on_test_end", dict(logs))
        t.model.train(was_training)
        return logs

    def predict(self, x: Any, batch_size: int, callbacks: Sequence[Callback]) -> torch.Tensor:
        """Return the model's outputs for ``x`` (a tensor, a dict of tensors or a dataset of ``(x, ...)`` items),
        on the CPU, computed by this replica alone."""
        t = self.trainer
        if isinstance(x, Mapping):  # a dict of tensors: the model's keyword arguments (labels left out)
            inputs = {k: v for k, v in x.items() if k != t.label_key}
            cbs = CallbackList(callbacks, trainer=t)
            n = len(next(iter(inputs.values())))
            return self._predict(lambda model, s: model(**{k: v[s].to(t.strategy.device) for k, v in inputs.items()}),
                                 n, batch_size, cbs)
        if is_stream(x):
            raise user_error("Trainer.predict takes tensors or a map-style dataset, not a stream",
                             type(x).__name__, "Predict on a tensor of inputs (e.g. torch.stack of the examples), "
                             "or run the model in your own loop over the stream.", cls=TypeError)
        if not isinstance(x, torch.Tensor):
            dataset = as_dataset(x, "x")
            x = torch.stack([dataset[i][0] if isinstance(dataset[i], (tuple, list)) else dataset[i]
                             for i in range(len(cast(Sized, dataset)))])
        tensor, cbs = x, CallbackList(callbacks, trainer=t)
        return self._predict(lambda model, s: model(tensor[s].to(t.strategy.device)), len(tensor), batch_size, cbs)

    def _predict(self, call: Any, n: int, batch_size: int, cbs: CallbackList) -> torch.Tensor:
        """The predictions of ``call(model, slice)`` for the ``n`` inputs, ``batch_size`` at a time."""
        t = self.trainer
        model: nn.Module = t.unwrapped_model
        was_training = model.training
        model.eval()
        outputs = []
        cbs.call("on_predict_begin", {})
        with torch.no_grad():
            for batch_index, start in enumerate(range(0, n, batch_size)):
                cbs.call("on_predict_batch_begin", batch_index, {})
                out = predictions(call(model, slice(start, start + batch_size)), t.prediction_key).float().cpu()
                outputs.append(out)
                cbs.call("on_predict_batch_end", batch_index, {"outputs": out})
        cbs.call("on_predict_end", {})
        model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)
