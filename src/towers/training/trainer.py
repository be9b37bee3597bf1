"""``Trainer``: Keras-style ``fit``/``evaluate``/``predict`` on top of any strategy.

The loop is the custom loop of the README, written once: ``strategy.prepare``,
``strategy.distribute_dataset``, ``strategy.run`` of a step that averages the per-example loss
with ``towers.compute_average_loss``, and ``strategy.reduce`` of the metric sums. Nothing in it
depends on which strategy runs it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any, Iterable, Iterator, Mapping, Sequence, Sized, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from towers._logging import get_logger
from towers.checkpoint import api as ckpt
from towers.checkpoint import layout as ckpt_layout
from towers.checkpoint.state import set_rng_state
from towers.data import BatchInfo, DistributedBatches, FollowsJob, find_batch_info, global_batch_sizes, is_stream
from towers.diagnostics.throughput import ThroughputMeter
from towers.errors import user_error
from towers.strategies.base import PeerLostError, Strategy, check_max_norm
from towers.training._state import TrainingProgress, capture_state, restore_state
from towers.training._steps import MetricSet, as_dataset, per_example, per_example_loss_fn
from towers.training._throughput import epoch_throughput
from towers.training.batches import BatchParts, call_model, label_count, loss_shifts_labels, model_loss, predictions
from towers.training.batches import split as split_batch
from towers.training.callbacks.base import Callback, CallbackList
from towers.training.callbacks.breakdown import with_step_breakdown
from towers.training.history import History
from towers.training.metrics import ExternalMetric, Metric, build_metrics

__all__ = ["Trainer"]

log = get_logger(__name__)

class Trainer:
    """Train, evaluate and predict with ``model`` under ``strategy``, Keras-style.

    ``loss`` is called as ``loss(y_pred, y_true, reduction="none")`` (an ``nn`` loss module is
    switched to ``reduction="none"``). ``metrics`` are names (``"accuracy"``, ``"top5_accuracy"``),
    ``towers.metrics.Metric``/torchmetrics objects or per-example functions. ``strategy=None`` means
    ``towers.strategy_from_env(precision=precision)``. Precision (``"32"``, ``"bf16"``, ``"fp16"``)
    belongs to the strategy; with a strategy given, ``precision`` must match it (or stay None).
    ``compile=True`` (or a dict of ``torch.compile`` options) has the strategy compile the model.

    ``log_every_n_steps``: training metrics are summed on each replica and reduced across replicas
    at every that-many-th step of each epoch (its first included) and at its last step (one collective,
    plus one for the stop decision). In between, ``on_train_batch_end`` logs hold the values of the last reduction,
    and a ``stop_training`` set by a callback takes effect at the next reduction — on every replica
    at the same step. Epoch logs and the History are exact whatever the value; 1 reduces every step,
    as does a single replica (nothing to communicate).

    Batches as real data has them: ``(x, y)`` tuples, or dicts of tensors passed to the model as
    keyword arguments (``model(**batch)``; the labels are ``batch[label_key]``). Outputs as models
    return them: a tensor, a tuple (nanoGPT's ``(logits, loss)``), a dict or a Hugging Face
    ``ModelOutput``; the predictions (for ``loss=``, metrics and ``predict``) are ``"logits"``, a
    tuple's first non-scalar tensor, or ``prediction_key``. ``loss=None`` trains on the loss the
    model returns (a mean over its label tokens) with one device's maths at any replica count and
    accumulation: the update is normalised by the GLOBAL count of labels (those not equal to
    ``ignore_index``) over every replica and micro-batch: the model's mean times this batch's label
    count (a model that takes ``num_items_in_batch``, as Hugging Face's do, is given that count)
    is its sum of label losses, and at the update step the gradient is divided by the global count.
    A tuple batch ``(x, y)`` is passed as ``model(x, y)`` then (nanoGPT's ``model(idx, targets)``).

    ``clip_grad_norm``: clip the gradient's global norm to this value before every update
    (``strategy.clip_grad_norm_``: once per update, on the complete gradient, under accumulation and
    on every replica count; fp16 gradients unscaled first).

    ``breakdown_every``: every that many global steps, each rank's time per step in input, forward,
    backward, comm_wait, optimizer and other is gathered (one small collective), the chief logs one
    line and names a rank whose compute is consistently slower than the others', and the logs get
    ``time/<phase>`` keys (``towers.callbacks.StepBreakdown``; None: every 100 steps, 0: off).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, loss: Any = None, *,
                 metrics: Iterable[Any] | Mapping[str, Any] | None = (), strategy: Strategy | None = None,
                 precision: Any = None, seed: int = 0, compile: bool | Mapping[str, Any] = False,
                 log_every_n_steps: int = 10, clip_grad_norm: float | None = None, label_key: str = "labels",
                 prediction_key: str | int | None = None, ignore_index: int = -100,
                 breakdown_every: int | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module. Received: {type(model).__name__}.")
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be a positive integer. Received: {log_every_n_steps!r}. "
                             "Use 1 to reduce the metrics every step, or e.g. 10.")
        if clip_grad_norm is not None:
            check_max_norm(clip_grad_norm)
        if breakdown_every is not None and (isinstance(breakdown_every, bool) or not isinstance(breakdown_every, int)
                                            or breakdown_every < 0):
            raise ValueError(f"breakdown_every must be None (the default period), 0 (off) or a positive integer. "
                             f"Received: {breakdown_every!r}.")
        self.breakdown_every = breakdown_every
        self.clip_grad_norm = clip_grad_norm
        if strategy is None:
            from towers.strategies import strategy_from_env

            strategy = strategy_from_env(**({} if precision is None else {"precision": precision}))
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a towers Strategy (e.g. towers.MirroredStrategy()) or None for "
                            f"towers.strategy_from_env(). Received: {type(strategy).__name__}.")
        self.strategy: Strategy = strategy
        self.loss_fn = per_example_loss_fn(loss) if loss is not None else None
        self.label_key, self.prediction_key, self.ignore_index = label_key, prediction_key, int(ignore_index)
        self.metrics: list[Metric | ExternalMetric] = build_metrics(metrics, strategy=strategy)
        self._train_metrics = MetricSet(self.metrics)
        self._val_metrics = MetricSet(copy.deepcopy(self.metrics))
        _check_precision(strategy, precision)
        self._passes_count = loss is None and _takes(model, "num_items_in_batch")
        # A causal LM's own loss predicts label i+1 from position i: it counts labels[..., 1:], and so does the Trainer.
        self._shifted_labels = loss is None and loss_shifts_labels(model)
        self.model, self.optimizer = strategy.prepare(model, optimizer, compile=compile)
        self.seed = int(seed)
        self.stop_training = False
        self.history = History()
        self.progress = TrainingProgress()
        self._callbacks = CallbackList()
        self._resume: dict[str, Any] | None = None
        self._last_global_batch_size: int | None = None
        self._train_batches: Any = None
        self.log_every_n_steps = log_every_n_steps
        self._unsynced: torch.Tensor | None = None  # metric sums of steps not yet reduced across replicas
        self._stop_pending = False  # a stop whose reduction failed (a lost peer): decided at the next one
        self._last_train_logs: dict[str, float] = {}
        self._nonfinite_warning = "unseen"  # -> "due" when a reduced loss is not finite -> "said"
        self._said_no_labels = False  # warned that the batches reduced at a step had no label token
        #: Examples/s, tokens/s and MFU of the training steps (``epoch_logs``; counts FLOPs at the first step).
        self.throughput = ThroughputMeter(strategy)
        #: The ``BatchInfo`` of the batch the last training step ran (None: a batch not from distribute_dataset).
        self.step_batch_info: BatchInfo | None = None

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's module inside whatever ``strategy.prepare`` wrapped it in."""
        return self.strategy.unwrap(self.model)

    # --- fit ---------------------------------------------------------------------------------------
    def fit(self, train_data: Any, epochs: int = 1, global_batch_size: int = 32, *,
            validation_data: Any = None, callbacks: Sequence[Callback] = (), steps_per_epoch: int | None = None,
            initial_epoch: int = 0, shuffle: bool = True) -> History:
        """Train for ``epochs`` epochs and return the History (the same on every replica).

        Raises:
            ValueError: on bad ``epochs``/``global_batch_size``/``steps_per_epoch``/``initial_epoch``.
            RuntimeError: when the Trainer has no optimizer.
        """
        if self.optimizer is None:
            raise user_error("Trainer.fit needs an optimizer", "Trainer(model, optimizer=None, ...)",
                             "Pass one, e.g. Trainer(model, torch.optim.Adam(model.parameters()), loss=...).",
                             cls=RuntimeError)
        for name, value, low in (("epochs", epochs, 1), ("global_batch_size", global_batch_size, 1),
                                 ("initial_epoch", initial_epoch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}. Received: {name}={value!r}.")
        if initial_epoch >= epochs:
            raise ValueError(f"epochs is the epoch to train up to, so it must be > initial_epoch. Received: epochs={epochs}, "
                             f"initial_epoch={initial_epoch}: nothing would train. Use epochs={initial_epoch + 1} or more.")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be a positive integer or None. Received: {steps_per_epoch!r}.")
        train_set = as_dataset(train_data, "train_data")
        val_set = None if validation_data is None else as_dataset(validation_data, "validation_data")
        self._last_global_batch_size = global_batch_size
        self._train_batches = None
        self.history = History()
        self.stop_training = self._stop_pending = False
        cbs = self._callbacks = CallbackList([self.history, *_ledger_first(self, callbacks)], trainer=self)
        cbs = self._callbacks = with_step_breakdown(cbs, self.breakdown_every)  # per-rank step time, stragglers
        steps: int | None = None  # a stream's length is known only at its end
        if not is_stream(train_set):
            steps = math.ceil(len(cast(Sized, train_set)) / global_batch_size)
        steps = min(steps, steps_per_epoch) if steps is not None and steps_per_epoch is not None else (
            steps if steps is not None else steps_per_epoch)
        cbs.set_params({"epochs": epochs, "steps": steps, "global_batch_size": global_batch_size,
                        "num_replicas": self.strategy.num_replicas_in_sync})
        self.progress = TrainingProgress(epoch=initial_epoch, global_batch_size=global_batch_size, seed=self.seed)
        self.model.train()
        cbs.call("on_train_begin", {})
        resume, self._resume = self._resume, None
        if resume is not None:
            self.progress = resume["progress"].resized(global_batch_size)
            for i, cb in enumerate(cbs):
                state = resume["callbacks"].get(f"{i}:{type(cb).__name__}")
                if state is not None and hasattr(cb, "load_state_dict"):
                    cb.load_state_dict(state)
        epoch_logs: dict[str, float] = {}
        while self.progress.epoch < epochs and not self.stop_training:
            self._follow_job(train_set, global_batch_size, shuffle, steps_per_epoch)
            if self.progress.epoch >= epochs:
                break  # the job trained these epochs already (a replica that joined it at its end)
            epoch = self.progress.epoch
            cbs.call("on_epoch_begin", epoch, {})
            self.throughput.reset()
            self._train_epoch(train_set, global_batch_size, steps_per_epoch, shuffle,
                              resume["rng"] if resume is not None else None)
            resume = None
            epoch_logs = self._train_metrics.results()
            epoch_logs.update(epoch_throughput(self.throughput, self.strategy))  # the chief's clock
            epoch_logs["examples"] = float(self._epoch_examples(train_set, global_batch_size))
            if val_set is not None:
                val_logs = self._evaluate(val_set, global_batch_size, cbs)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            groups = getattr(self.optimizer, "param_groups", None)
            epoch_logs["lr"] = float(groups[0]["lr"]) if groups else math.nan
            self.progress = self.progress.next_epoch()
            cbs.call("on_epoch_end", epoch, epoch_logs)
            self.stop_training = self._any_replica(self.stop_training)
        cbs.call("on_train_end", dict(epoch_logs))
        return self.history

    def _train_epoch(self, train_set: Dataset, global_batch_size: int, steps_per_epoch: int | None,
                     shuffle: bool, rng: Any) -> None:
        p = self.progress
        self._unsynced = None
        if p.step == 0:  # a fresh epoch (a mid-epoch resume keeps the restored running sums)
            self._train_metrics.reset()
            self._last_train_logs = {}
            if rng is not None:  # saved at an epoch boundary: before this epoch built its iterator
                set_rng_state(rng)
                rng = None
        it = self._epoch_iterator(train_set, global_batch_size, shuffle, p.epoch, p.step)
        batches = self._train_batches
        if isinstance(batches, DistributedBatches):
            batches.last_pass = None  # set again when this epoch's pass completes (parameter servers)
        job = batches if isinstance(batches, FollowsJob) else None
        if rng is not None:
            # Saved mid-epoch, after the iterator was built (which may draw from the RNGs): restore
            # only once this run's iterator is built and positioned.
            set_rng_state(rng)
        for batch_index, batch in enumerate(it, start=p.step):
            if job is not None:  # the job's step: a step retried after one that did not commit has its index
                self.progress = p = self._job_progress(train_set, global_batch_size, *job.job_position())
                batch_index = p.step
            if steps_per_epoch is not None and batch_index >= steps_per_epoch:
                break
            self._callbacks.call("on_train_batch_begin", batch_index, {})
            with self.throughput.step(batch):
                size, sums = self._train_step(batch)
            if job is None:
                self.progress = p = p.after_step(size)
            else:
                after = self._job_progress(train_set, global_batch_size, *job.job_position(), within=p.epoch)
                if after == p:
                    # Not committed (a group was lost mid-step): its update was dropped on every live group, which
                    # all retry the same global batch next. It counts nowhere: no examples, metric sums or logs.
                    continue
                self.progress = p = after
            self._unsynced = sums if self._unsynced is None else self._unsynced + sums
            # Collectives only at every log_every_n_steps-th step of the epoch (its first included) and at its
            # last step: in between, the logs hold the values of the last synchronisation. The step's place in
            # the epoch decides, so a replica that joined a running job (FollowsJob) reduces at the same steps.
            sync = (batch_index % self.log_every_n_steps == 0
                    or _last_of_epoch(batch, batch_index, batches, steps_per_epoch)
                    or (not self._last_train_logs and job is None)  # a resumed epoch's first logs
                    or self._syncing_is_free)
            logs = self._sync_train_metrics() if sync else dict(self._last_train_logs)
            logs.update({"size": float(size), "examples": p.examples, "global_step": p.global_step})
            self._callbacks.call("on_train_batch_end", batch_index, logs)
            if sync:
                self.stop_training = self._any_replica(self.stop_training)
                self._warn_nonfinite(logs)
                if self.stop_training:
                    break
        self._sync_train_metrics()  # the epoch's sums are complete before its logs are read

    @property
    def _syncing_is_free(self) -> bool:
        """One replica on the CPU: reducing is free, so every step's logs are exact. On a GPU, reading the sums
        every step would make the host wait for the device's queue at each step."""
        return self.strategy.num_replicas_in_sync == 1 and self.strategy.device.type == "cpu"

    def _epoch_examples(self, train_set: Dataset, global_batch_size: int) -> int:
        """The examples this epoch trained on: as the parameter servers counted them, else its global batches'."""
        batches = self._train_batches
        counted = batches.last_pass if isinstance(batches, DistributedBatches) else None
        if counted is not None:
            if counted["examples"] != counted["expected"]:
                log.warning("epoch %d trained on %d of its %d examples", self.progress.epoch, counted["examples"],
                            counted["expected"])
            return int(counted["examples"])
        if is_stream(train_set):
            return self.progress.examples  # every global batch of a stream is counted as it is trained
        return sum(global_batch_sizes(len(cast(Sized, train_set)), global_batch_size)[:self.progress.step])

    def _train_input(self, train_set: Dataset, global_batch_size: int, shuffle: bool) -> Any:
        """The strategy's distributed training input of this fit (made on first use)."""
        if self._train_batches is None:
            self._train_batches = self.strategy.distribute_dataset(train_set, global_batch_size, shuffle=shuffle,
                                                                   seed=self.seed, drop_remainder=False)
            if hasattr(self._train_batches, "in_ledger"):  # handed out at run time: ps task 0 records what it applied
                from towers.training.callbacks.ledger import ExampleLedger

                self._train_batches.in_ledger = any(isinstance(cb, ExampleLedger) for cb in self._callbacks)
        return self._train_batches

    def _follow_job(self, train_set: Dataset, global_batch_size: int, shuffle: bool,
                    steps_per_epoch: int | None) -> None:
        """At an epoch's start, take the epoch and step from an input whose position is the job's (``FollowsJob``).

        A replica group that joined a running job (started again after a failure, fault tolerance)
        so continues in the job's epoch at the job's step, as the live groups do; ``initial_epoch``
        and a restored position give way to the job's.

        Raises:
            ValueError: ``steps_per_epoch`` shorter than the input's epoch (the job's epochs are whole passes).
        """
        batches = self._train_input(train_set, global_batch_size, shuffle)
        if not isinstance(batches, FollowsJob):
            return
        per_epoch = math.ceil(len(cast(Sized, train_set)) / global_batch_size)
        if steps_per_epoch is not None and steps_per_epoch < per_epoch:
            raise user_error(f"steps_per_epoch must cover the whole dataset under {type(self.strategy).__name__}, "
                             f"whose epochs are the job's passes over it ({per_epoch} steps)",
                             f"steps_per_epoch={steps_per_epoch}",
                             "Leave steps_per_epoch=None, or pass a smaller dataset (e.g. a torch.utils.data.Subset).")
        p = self.progress
        self.progress = self._job_progress(train_set, global_batch_size, *batches.job_position())
        if (self.progress.epoch, self.progress.step) != (p.epoch, p.step):
            log.info("following the job: epoch %d, step %d (this replica was at epoch %d, step %d)",
                     self.progress.epoch, self.progress.step, p.epoch, p.step)

    def _job_progress(self, train_set: Dataset, global_batch_size: int, epoch: int, step: int, *,
                      within: int | None = None) -> TrainingProgress:
        """The progress at the job's ``(epoch, step)``; ``within``: clamped to the end of that epoch."""
        size = len(cast(Sized, train_set))
        per_epoch = math.ceil(size / global_batch_size)  # the Trainer keeps the last, partial global batch
        if within is not None and epoch > within:  # the step committed was the epoch's last
            epoch, step = within, per_epoch
        return dataclasses.replace(self.progress, epoch=epoch, step=step, examples=min(step * global_batch_size, size),
                                   global_step=epoch * per_epoch + step)

    def _epoch_iterator(self, train_set: Dataset, global_batch_size: int, shuffle: bool, epoch: int,
                        start: int) -> Iterator[Any]:
        # An epoch's order is fixed by (seed, epoch), independent of the replica count, so a resumed
        # run starts at batch `start` of the same order.
        batches = self._train_input(train_set, global_batch_size, shuffle)
        if isinstance(batches, DistributedBatches):
            batches.set_epoch(epoch)  # order: seed + epoch
            return iter(batches.iter_from(start))
        # A strategy whose datasets know no epochs: a new one per epoch, seeded with seed + epoch
        batches = self._train_batches = self.strategy.distribute_dataset(
            train_set, global_batch_size, shuffle=shuffle, seed=self.seed + epoch, drop_remainder=False)
        it = iter(batches)
        for _ in range(start):
            next(it, None)
        return it

    def _train_step(self, batch: Any) -> tuple[int, torch.Tensor]:
        """Run one step; return the step's global batch size and this replica's metric sums of it."""
        parts = split_batch(batch, label_key=self.label_key, with_labels_in_inputs=self.loss_fn is None)
        y = parts.labels
        from towers.losses import compute_average_loss

        def step(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            parts = split_batch(batch, label_key=self.label_key, with_labels_in_inputs=self.loss_fn is None)
            if self.loss_fn is not None:
                outputs = call_model(self.model, parts)  # the prepared model applies its precision policy
                y_pred = predictions(outputs, self.prediction_key)
                per_example = self.loss_fn(y_pred, _labels(parts, self.label_key))
                if per_example.dim() == 0:  # a loss that returns its batch's mean: one device's mean over the labels
                    return self._mean_loss_step(parts, per_example, outputs), y_pred.detach()
                self.strategy.backward(compute_average_loss(per_example))  # fp16 scales the loss first
                self._update()
                return per_example.detach(), y_pred.detach()
            return self._own_loss_step(parts)

        try:  # the batch as distribute_dataset yielded it: run reads its accounting from its tensors
            losses, y_pred = self.strategy.run(step, args=(batch,))
        except RuntimeError as exc:
            if "cannot be multiplied" not in str(exc) and "size mismatch" not in str(exc):
                raise
            x = parts.inputs
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"The model cannot take this batch: its input has shape {shape} (batch first), and torch says: "
                f"{str(exc).splitlines()[0]}. Make the data's feature shape match the model's first layer (e.g. "
                "nn.Linear(in_features=...) equal to the last dimension of x), or reshape/flatten x.") from exc
        if y is None:
            y = torch.zeros(len(y_pred), device=y_pred.device)  # no labels: only the loss is a metric then
        losses = per_example(losses, len(losses))
        nonfinite = (~torch.isfinite(losses)).any().to(torch.float64).reshape(1)
        local = torch.cat([self._train_metrics.local_state(losses, y_pred, y), nonfinite])
        info = self.step_batch_info = find_batch_info((batch,))
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
        outputs = call_model(self.model, parts, **extra)
        shown = self._backward_mean(model_loss(outputs), count, outputs)
        return shown.expand(count).clone(), _predictions_or(outputs, self.prediction_key, shown)

    def _mean_loss_step(self, parts: BatchParts, mean: torch.Tensor, outputs: Any) -> torch.Tensor:
        """A step on ``loss=`` that returned its batch's mean (it takes no ``reduction=``): weighted by its labels."""
        count = label_count(parts, self.ignore_index)
        return self._backward_mean(mean, count, outputs).expand(count).clone()

    def _backward_mean(self, mean: torch.Tensor, count: int, outputs: Any) -> torch.Tensor:
        """Backpropagate a loss that is the mean over ``count`` labels, normalised by the update's global label count.

        Returns the mean, detached (one loss per label: the loss metric is label-weighted)."""
        from towers.losses import compute_average_loss

        if count == 0:  # no label here (an empty share): a zero gradient, not the NaN of a mean over nothing
            mean = _zero_loss(outputs, mean)
        # The strategy divides the update's gradient by the label count over every replica and micro-batch.
        # The count lives on the host (compute_average_loss reads it there, without waiting for the device).
        weights = torch.full((1,), float(count), device="cpu")
        self.strategy.backward(compute_average_loss(mean.reshape(1), weights=weights))
        self._update()
        return mean.detach().float()

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
            self._last_train_logs = {**self._train_metrics.results(external=False),
                                     "nonfinite_replicas": float(reduced[-1].item())}
            if reduced[-1].item() > 0 and self._nonfinite_warning == "unseen":
                self._nonfinite_warning = "due"  # said after the callbacks, unless one of them stops training
            if reduced[1].item() == 0:  # the loss's count: no label token in any batch since the last reduction
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
    def evaluate(self, data: Any, global_batch_size: int | None = None, *,
                 callbacks: Sequence[Callback] = ()) -> dict[str, float]:
        """Return ``{"loss": ..., metric: ...}`` over ``data``, reduced across replicas (the same on every replica)."""
        gbs = global_batch_size
        if gbs is None:
            gbs = self._last_global_batch_size or 32 * self.strategy.num_replicas_in_sync
        if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
            raise ValueError(f"global_batch_size must be a positive integer (or None for fit's). Received: {gbs!r}.")
        return self._evaluate(as_dataset(data, "data"), gbs, CallbackList(callbacks, trainer=self))

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
                    outputs = call_model(self.model, parts)
                    if self.loss_fn is not None:
                        y_pred = predictions(outputs, self.prediction_key)
                        losses = self.loss_fn(y_pred, _labels(parts, self.label_key)).detach()
                        if losses.dim() == 0:  # a loss that returns its batch's mean: one per label, as in training
                            losses = losses.float().expand(label_count(parts, self.ignore_index)).clone()
                        return losses, y_pred.detach()
                    count = label_count(parts, self.ignore_index, shifted=self._shifted_labels)  # one loss per label
                    mean = model_loss(outputs).detach().float()
                    return mean.expand(count).clone(), _predictions_or(outputs, self.prediction_key, mean)

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
            raise ValueError(f"batch_size must be a positive integer. Received: {batch_size!r}.")
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
        cbs = CallbackList(callbacks, trainer=self)
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
        cbs = CallbackList(callbacks, trainer=self)
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
    def state_dict(self) -> dict[str, Any]:
        """Return the full training state in the checkpoint format (a collective: call it on every replica)."""
        return capture_state(self)

    def load_state_dict(self, state: Mapping[str, Any], *, path: str = "<state>") -> None:
        """Restore a full training state; the next ``fit`` resumes at its exact step (on every replica).

        Raises:
            CheckpointError: when the state does not fit this model/optimizer; nothing is changed then.
        """
        self._resume = restore_state(self, state, path=path)

    def save_checkpoint(self, path: str, *, weights_only: bool = False) -> str:
        """Write a checkpoint of this Trainer at ``path`` (call on every replica); return its path.

        Any strategy and number of replicas restores it (``load_checkpoint``). ``weights_only``:
        the model alone.
        """
        if weights_only:
            state: dict[str, Any] = {"model": self.strategy.state_dict(self.model)["model"]}
        else:
            state = self.state_dict()
        ckpt.write_checkpoint(path, state, strategy=self.strategy, distributed_keys=("model", "optimizer"))
        return str(path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Read a checkpoint (every replica reads it); a full one makes the next ``fit`` resume from it. Returns its values.

        Raises:
            CheckpointError: when it does not fit this model and optimizer (nothing is changed then).
        """
        manifest = ckpt_layout.read_manifest(path)
        full = "epoch" in manifest["state"]
        state, _ = ckpt.read_into(path, strategy=self.strategy, model=self.model,
                                  optimizer=self.optimizer if full else None, manifest=manifest)
        if full:
            self.load_state_dict(state, path=str(path))
        else:
            self.strategy.load_state_dict({"model": state["model"]}, self.model)
        return state


def _labels(parts: BatchParts, label_key: str) -> torch.Tensor:
    if parts.labels is None:
        raise user_error("Trainer(loss=...) compares the predictions with the batch's labels, but this batch has none",
                         f"a {'dict without ' + repr(label_key) if parts.as_kwargs else 'batch without a second item'}",
                         "Give batches as (x, y) or dicts with the labels under label_key, or pass loss=None to train "
                         "on the loss the model returns.")
    return parts.labels


def _last_of_epoch(batch: Any, index: int, batches: Any, steps_per_epoch: int | None) -> bool:
    """True when step ``index`` (this batch) is the epoch's last: ``steps_per_epoch`` ends it here, it is the
    last of the dataset's known number of batches, or (a stream, whose length is known only at its end) its
    accounting says so. Every replica decides the same: the collectives it starts stay paired."""
    if steps_per_epoch is not None and index + 1 >= steps_per_epoch:
        return True
    total = batches.batches_per_epoch if isinstance(batches, DistributedBatches) else None
    if total is not None:
        return index + 1 == total
    info = find_batch_info((batch,))  # a stream's batches are split statically: the same index on every replica
    return info is not None and info.num_batches == info.index + 1


def _zero_loss(outputs: Any, loss: torch.Tensor) -> torch.Tensor:
    """A zero loss connected to the model's outputs (its gradient is zero, never NaN)."""
    try:
        return predictions(outputs, None).sum() * 0.0
    except ValueError:
        return torch.nan_to_num(loss, nan=0.0) * 0.0


def _predictions_or(outputs: Any, key: str | int | None, fallback: torch.Tensor) -> torch.Tensor:
    """The model's predictions, or ``fallback`` when its output holds none (a model returning only its loss)."""
    try:
        return predictions(outputs, key).detach()
    except ValueError:
        return fallback.reshape(1)


def _takes(model: nn.Module, name: str) -> bool:
    """True when ``model.forward`` takes ``name`` (Hugging Face's ``num_items_in_batch``: named, or through the
    ``**kwargs`` a transformers model hands its ``loss_function``)."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if name in parameters:
        return True
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return var_keyword and hasattr(type(model), "loss_function")


def _check_precision(strategy: Strategy, precision: Any) -> None:
    # Precision is the strategy's (its prepared model autocasts, its backward scales the loss):
    # the Trainer only checks that the two agree.
    if precision is None:
        return
    from towers.strategies.precision import resolve_precision

    wanted = resolve_precision(precision, strategy.device).name
    actual = strategy.precision.name
    if wanted != actual:
        raise ValueError(
            f"Trainer(precision={precision!r}) but the strategy computes in precision {actual!r}. Precision belongs "
            f"to the strategy: build it with precision={precision!r} (e.g. towers.strategy_from_env(precision=...)), "
            "or leave Trainer's precision unset.")


def _ledger_first(trainer: Trainer, callbacks: Sequence[Callback]) -> list[Callback]:
    """fit's callbacks, an ``ExampleLedger`` first: the one given, else one when the job keeps a ledger
    (``TOWERS_LEDGER_DIR``). First, so a step is recorded before a callback saves a checkpoint or stops the process."""
    from towers.training.callbacks.ledger import ExampleLedger

    ledgers = [cb for cb in callbacks if isinstance(cb, ExampleLedger)]
    run_dir = trainer.strategy.process_info.ledger_dir
    if not ledgers and run_dir is not None:
        ledgers = [ExampleLedger(run_dir)]
    return [*ledgers, *(cb for cb in callbacks if not isinstance(cb, ExampleLedger))]

