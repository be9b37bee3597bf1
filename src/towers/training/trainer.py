"""``Trainer``: Keras-style ``fit``/``evaluate``/``predict`` on top of any strategy.

The loop is the custom loop of the README, written once: ``strategy.prepare``,
``strategy.distribute_dataset``, ``strategy.run`` of a step that averages the per-example loss
with ``towers.compute_average_loss``, and ``strategy.reduce`` of the metric sums. Nothing in it
depends on which strategy runs it.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Iterable, Mapping, Sequence, Sized, cast

import torch
from torch import nn

from towers._logging import get_logger
from towers.checkpoint import api as ckpt
from towers.checkpoint import layout as ckpt_layout
from towers.data import BatchInfo, is_stream
from towers.diagnostics.throughput import ThroughputMeter
from towers.errors import InvalidArgumentError, InvalidTypeError, user_error
from towers.strategies.base import Strategy, check_max_norm
from towers.training._epoch_loop import EpochLoop
from towers.training._inference import Inference
from towers.training._metric_sync import MetricSync
from towers.training._state import TrainingProgress, capture_state, restore_state
from towers.training._step_runner import ModelLabels, StepRunner
from towers.training._steps import MetricSet, as_dataset, per_example_loss_fn
from towers.training._stop_decision import StopDecision
from towers.training._throughput import epoch_throughput
from towers.training.callbacks.base import Callback, CallbackList
from towers.training.callbacks.breakdown import with_step_breakdown
from towers.training.history import History
from towers.training.metrics import ExternalMetric, Metric, build_metrics

__all__ = ["Trainer"]

log = get_logger(__name__)

class Trainer:
    """Train, evaluate and predict with ``model`` under ``strategy``, Keras-style.

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
    A tuple batch ``(x, y)`` gives the model its labels where its forward takes them: ``model(x, y)``
    when its second parameter is named like labels (nanoGPT's ``forward(idx, targets)``), else
    ``model(x, labels=y)`` (Hugging Face's ``input_ids``, ``labels``); a forward that takes neither is
    refused before the first step, and so is a dict batch without ``label_key`` for a model whose
    forward takes it.

    Args:
        model: the model, built on the CPU or under ``strategy.scope()``; the Trainer prepares it.
        optimizer: its optimizer (None: a Trainer that only evaluates and predicts).
        loss: called as ``loss(y_pred, y_true, reduction="none")`` (an ``nn`` loss module is switched to
            ``reduction="none"``); None: the loss the model returns.
        metrics: names (``"accuracy"``, ``"top5_accuracy"``), ``towers.metrics.Metric`` / torchmetrics
            objects or per-example functions; a mapping names them.
        strategy: the strategy. Default: ``towers.strategy_from_env(precision=precision)``.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``. Precision belongs to the strategy; with a strategy
            given, it must match the strategy's (or stay None).
        seed: the seed of the training data's shuffled order (epoch ``e`` uses ``seed + e``).
        compile: True (or a dict of ``torch.compile`` options) has the strategy compile the model.
        activation_checkpointing: ``"off"``, ``"block"`` or ``"selective"``: the strategy recomputes the
            model's repeated blocks' activations in backward (``strategy.prepare``): less memory for more
            compute.
        log_every_n_steps: training metrics are summed on each replica and reduced across replicas at every
            that-many-th step of each epoch (its first included) and at its last step (one collective, plus
            one for the stop decision). In between, ``on_train_batch_end`` logs hold the values of the last
            reduction, and a ``stop_training`` set by a callback takes effect at the next reduction, on
            every replica at the same step. Epoch logs and the History are exact whatever the value; 1
            reduces every step, as does a single replica (nothing to communicate).
        clip_grad_norm: clip the gradient's global norm to this value before every update
            (``strategy.clip_grad_norm_``: once per update, on the complete gradient, under accumulation and
            on every replica count; fp16 gradients unscaled first).
        label_key: the key of the labels in a dict batch.
        prediction_key: the key (or tuple index) of the predictions in the model's output.
        ignore_index: the label that does not count (padding) when the model's own loss is normalised.
        breakdown_every: every that many global steps, each rank's time per step in input, forward,
            backward, comm_wait (a job that communicates), cpu_wait, optimizer and other is gathered (one
            small collective), the chief logs it on a line of its own and names a rank whose compute is
            consistently slower than the others', and the logs of that step and of its epoch get
            ``time/<phase>`` keys (``towers.callbacks.StepBreakdown``; None: every 100 steps, 0: off).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: an option out of range, or a ``precision`` other than the given strategy's.

    Example:
        ```python
        import torch
        import towers

        data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        trainer = towers.Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                 loss=torch.nn.CrossEntropyLoss(), metrics=["accuracy"])
        history = trainer.fit(data, epochs=2, global_batch_size=64)
        print(history.history["loss"], trainer.evaluate(data))
        ```
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, loss: Any = None, *,
                 metrics: Iterable[Any] | Mapping[str, Any] | None = (), strategy: Strategy | None = None,
                 precision: Any = None, seed: int = 0, compile: bool | Mapping[str, Any] = False,
                 activation_checkpointing: str = "off",
                 log_every_n_steps: int = 10, clip_grad_norm: float | None = None, label_key: str = "labels",
                 prediction_key: str | int | None = None, ignore_index: int = -100,
                 breakdown_every: int | None = None):
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(f"model must be a torch.nn.Module. Received: {type(model).__name__}.")
        if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
            raise InvalidArgumentError(f"log_every_n_steps must be a positive integer. Received: {log_every_n_steps!r}. "
                                       "Use 1 to reduce the metrics every step, or e.g. 10.")
        if clip_grad_norm is not None:
            check_max_norm(clip_grad_norm)
        if breakdown_every is not None and (isinstance(breakdown_every, bool) or not isinstance(breakdown_every, int)
                                            or breakdown_every < 0):
            raise InvalidArgumentError(f"breakdown_every must be None (the default period), 0 (off) or a positive integer. "
                                       f"Received: {breakdown_every!r}.")
        self.breakdown_every = breakdown_every
        self.clip_grad_norm = clip_grad_norm
        if strategy is None:
            from towers.strategies import strategy_from_env

            strategy = strategy_from_env(**({} if precision is None else {"precision": precision}))
        if not isinstance(strategy, Strategy):
            raise InvalidTypeError(f"strategy must be a towers Strategy (e.g. towers.MirroredStrategy()) or None for "
                                   f"towers.strategy_from_env(). Received: {type(strategy).__name__}.")
        self.strategy: Strategy = strategy
        self.loss_fn: Any = per_example_loss_fn(loss) if loss is not None else None
        self.label_key, self.prediction_key, self.ignore_index = label_key, prediction_key, int(ignore_index)
        self.metrics: list[Metric | ExternalMetric] = build_metrics(metrics, strategy=strategy)
        train_metrics, val_metrics = MetricSet(self.metrics), MetricSet(copy.deepcopy(self.metrics))
        _check_precision(strategy, precision)
        labels = ModelLabels.of(model, loss, label_key)  # how the model's own loss takes and counts its labels
        # Passed only when asked for: a strategy of the user's own may take compile= alone.
        checkpointing = {} if activation_checkpointing == "off" else {"activation_checkpointing": activation_checkpointing}
        self.model, self.optimizer = strategy.prepare(model, optimizer, compile=compile, **checkpointing)
        self.seed = int(seed)
        self.stop_training = False
        self.history = History()
        self.progress = TrainingProgress()
        self._callbacks = CallbackList()  # the last fit's
        self._resume: dict[str, Any] | None = None  # what the next fit restores (load_state_dict)
        self._last_global_batch_size: int | None = None  # the last fit's (evaluate's default)
        self.joined_job = False
        self.log_every_n_steps = log_every_n_steps
        #: Examples/s, tokens/s and MFU of the training steps (``epoch_logs``; counts FLOPs at the first step).
        self.throughput = ThroughputMeter(strategy)
        #: The ``BatchInfo`` of the batch the last training step ran (None: a batch not from distribute_dataset).
        self.step_batch_info: BatchInfo | None = None
        # The parts that do the work, each an object the Trainer holds (they read its public attributes):
        self._metric_sync = MetricSync(strategy, train_metrics, ignore_index=self.ignore_index)  # training metrics
        self._stop = StopDecision(strategy)  # stop_training, decided on every replica at once
        self._steps = StepRunner(self, labels, train_metrics)  # one training step and its update
        self._epochs = EpochLoop(self, self._steps, self._metric_sync, self._stop)  # the input, an epoch's steps
        self._inference = Inference(self, labels, val_metrics)  # evaluate (fit's validation too) and predict

    @property
    def train_input(self) -> Any:
        """The distributed training input of the current (or last) ``fit``, as ``strategy.distribute_dataset`` made it."""
        return self._epochs.train_input

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's module inside whatever ``strategy.prepare`` wrapped it in."""
        return self.strategy.unwrap(self.model)

    # --- fit ---------------------------------------------------------------------------------------
    def fit(self, train_data: Any, epochs: int = 1, global_batch_size: int = 32, *,
            validation_data: Any = None, callbacks: Sequence[Callback] = (), steps_per_epoch: int | None = None,
            initial_epoch: int = 0, shuffle: bool = True) -> History:
        """Train for ``epochs`` epochs and return the History (the same on every replica).

        Args:
            train_data: a map-style dataset of ``(x, y)`` items or dicts, a tuple ``(x, y)`` of tensors, a dict
                of tensors, or a stream (``towers.data``).
            epochs: the epoch to train up to (with ``initial_epoch``, ``epochs - initial_epoch`` epochs run).
            global_batch_size: the examples of one update over all replicas.
            validation_data: evaluated after each epoch; its results are logged as ``val_<name>``.
            callbacks: ``towers.callbacks`` objects, called on every replica.
            steps_per_epoch: stop each epoch after this many steps (default: one pass over the data).
            initial_epoch: the epoch to start at (e.g. when resuming).
            shuffle: a new order of the training data every epoch, the same on every replica.

        Returns:
            The ``History``: ``history.history[name]`` holds each epoch's value of every metric.

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
                raise InvalidArgumentError(f"{name} must be an integer >= {low}. Received: {name}={value!r}.")
        if initial_epoch >= epochs:
            raise InvalidArgumentError("epochs is the epoch to train up to, so it must be > initial_epoch. "
                                       f"Received: epochs={epochs}, initial_epoch={initial_epoch}: nothing would train. "
                                       f"Use epochs={initial_epoch + 1} or more.")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise InvalidArgumentError(f"steps_per_epoch must be a positive integer or None. Received: {steps_per_epoch!r}.")
        train_set = as_dataset(train_data, "train_data")
        val_set = None if validation_data is None else as_dataset(validation_data, "validation_data")
        self._last_global_batch_size = global_batch_size
        self._epochs.start(train_set, global_batch_size, shuffle=shuffle, steps_per_epoch=steps_per_epoch)
        self.joined_job = False
        self.history = History()
        self.stop_training = False
        self._stop.reset()
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
            self._epochs.follow_job(cbs)
            if self.progress.epoch >= epochs:
                break  # the job trained these epochs already (a replica that joined it at its end)
            epoch = self.progress.epoch
            cbs.call("on_epoch_begin", epoch, {})
            self.throughput.reset()
            self._epochs.run(cbs, resume["rng"] if resume is not None else None)
            resume = None
            epoch_logs = self._metric_sync.metrics.results()
            epoch_logs.update(epoch_throughput(self.throughput, self.strategy))  # the chief's clock
            epoch_logs["examples"] = float(self._epochs.examples())
            if val_set is not None:
                val_logs = self._inference.evaluate(val_set, global_batch_size, cbs)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            groups = getattr(self.optimizer, "param_groups", None)
            epoch_logs["lr"] = float(groups[0]["lr"]) if groups else math.nan
            self.progress = self.progress.next_epoch()
            cbs.call("on_epoch_end", epoch, epoch_logs)
            self.stop_training = self._stop.any_replica(self.stop_training, self.progress.global_step)
        cbs.call("on_train_end", dict(epoch_logs))
        return self.history

    # --- evaluate and predict ----------------------------------------------------------------------
    def evaluate(self, data: Any, global_batch_size: int | None = None, *,
                 callbacks: Sequence[Callback] = ()) -> dict[str, float]:
        """Return ``{"loss": ..., metric: ...}`` over ``data``, reduced across replicas (the same on every replica).

        Args:
            data: a dataset as ``fit`` takes it.
            global_batch_size: the examples of one step over all replicas. Default: the last ``fit``'s, else
                32 per replica.
            callbacks: called with ``on_test_*`` hooks.

        Returns:
            The loss and each metric over all of ``data``.

        Raises:
            ValueError: a ``global_batch_size`` that is not a positive integer.
        """
        gbs = global_batch_size
        if gbs is None:
            gbs = self._last_global_batch_size or 32 * self.strategy.num_replicas_in_sync
        if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
            raise InvalidArgumentError(f"global_batch_size must be a positive integer (or None for fit's). Received: {gbs!r}.")
        return self._inference.evaluate(as_dataset(data, "data"), gbs, CallbackList(callbacks, trainer=self))

    def predict(self, x: Any, *, batch_size: int = 256, callbacks: Sequence[Callback] = ()) -> torch.Tensor:
        """Return the model's outputs for ``x`` (a tensor or a dataset of ``(x, ...)`` items), on the CPU.

        Every replica computes all of ``x`` with its own copy of the model (no communication), so
        every replica returns the same tensor.

        Args:
            x: the inputs: a tensor, or a dataset whose items are ``(x, ...)``.
            batch_size: the examples per forward.
            callbacks: called with ``on_predict_*`` hooks.

        Returns:
            The predictions for every example of ``x``, in order, on the CPU.

        Raises:
            ValueError: a ``batch_size`` that is not a positive integer.
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer. Received: {batch_size!r}.")
        return self._inference.predict(x, batch_size, callbacks)

    # --- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the full training state in the checkpoint format (a collective: call it on every replica).

        Returns:
            The model, optimizer, progress, data position, metrics, callbacks' states and RNG streams.
        """
        self._metric_sync.sync(self.progress.global_step)  # running sums of steps not yet reduced belong in it
        return capture_state(self, train_input=self._epochs.train_input, callbacks=self._callbacks,
                             train_metrics=self._metric_sync.metrics)

    def load_state_dict(self, state: Mapping[str, Any], *, path: str = "<state>") -> None:
        """Restore a full training state; the next ``fit`` resumes at its exact step (on every replica).

        Args:
            state: what ``state_dict`` returned (or a checkpoint's dict).
            path: where it came from, for error messages.

        Raises:
            CheckpointError: when the state does not fit this model/optimizer; nothing is changed then.
        """
        self._resume = restore_state(self, state, train_metrics=self._metric_sync.metrics, path=path)

    def save_checkpoint(self, path: str, *, weights_only: bool = False) -> str:
        """Write a checkpoint of this Trainer at ``path`` (call on every replica); return its path.

        Any strategy and number of replicas restores it (``load_checkpoint``).

        Args:
            path: the checkpoint's folder.
            weights_only: write the model alone.

        Returns:
            The path.
        """
        if weights_only:
            state: dict[str, Any] = {"model": self.strategy.state_dict(self.model)["model"]}
        else:
            state = self.state_dict()
        ckpt.write_checkpoint(path, state, strategy=self.strategy, distributed_keys=("model", "optimizer"))
        return str(path)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Read a checkpoint (every replica reads it); a full one makes the next ``fit`` resume from it. Returns its values.

        Args:
            path: the checkpoint's folder, as ``save_checkpoint`` (or ``ModelCheckpoint``) wrote it.

        Returns:
            The checkpoint's values.

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


def _check_precision(strategy: Strategy, precision: Any) -> None:
    # Precision is the strategy's (its prepared model autocasts, its backward scales the loss):
    # the Trainer only checks that the two agree.
    if precision is None:
        return
    from towers.strategies.precision import resolve_precision

    wanted = resolve_precision(precision, strategy.device).name
    actual = strategy.precision.name
    if wanted != actual:
        raise InvalidArgumentError(
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

