"""``Callback`` (no-op hooks, Keras's names) and ``CallbackList`` (calls them in order).

``logs`` keys, as the Trainer fills them in (every value already reduced across replicas, so
every replica sees the same numbers and takes the same decisions):

* ``on_train_batch_end(batch, logs)``: ``loss`` and each metric (running means over the epoch so
  far), ``size`` (examples in this global batch), ``examples`` (examples seen this epoch),
  ``nonfinite_replicas`` (replicas whose loss for this batch was NaN/inf), ``global_step``.
* ``on_epoch_end(epoch, logs)``: ``loss``, each metric, ``examples`` (examples the epoch trained on),
  ``val_loss``/``val_<metric>``/``val_examples`` when ``fit`` got ``validation_data``, ``lr`` (the
  first param group's learning rate), ``examples_per_second``, ``tokens_per_second`` (token models) and
  ``mfu`` (model-FLOPs utilisation, 0..1; left out where the device's peak is unknown): the epoch's
  training steps on the chief's clock (``towers.ThroughputMeter``).
* ``on_test_end``: ``loss``, each metric and ``examples`` (no ``val_`` prefix); ``on_test_batch_end``: ``{}``.
* ``on_predict_batch_end(batch, logs)``: ``outputs`` (this batch's predictions).
* ``*_begin`` hooks get ``{}`` (``on_train_batch_begin`` gets ``{"size": ...}`` when known).

Side effects (files, printing) belong to the chief: test ``self.trainer.strategy.is_chief``. Never
call a collective inside such a branch: every replica must reach every collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

from towers.errors import FailedPreconditionError, InvalidTypeError, user_error

if TYPE_CHECKING:
    from torch import nn

    from towers.training.trainer import Trainer

__all__ = ["Callback", "CallbackList"]

_HOOKS = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
    "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
    "on_predict_batch_begin", "on_predict_batch_end",
)


class Callback:
    """Base class of callbacks: every hook is a no-op; override the ones you need.

    ``self.trainer`` is set by the Trainer before the first hook; ``self.model`` is the user's
    (unwrapped) module. Callbacks that hold state across a restart may implement
    ``state_dict()``/``load_state_dict(state)``; ``BackupAndRestore`` saves and restores it.
    """

    def __init__(self) -> None:
        self._trainer: "Trainer | None" = None
        self.params: dict[str, Any] = {}

    def set_trainer(self, trainer: "Trainer") -> None:
        """Attach the Trainer whose loop calls this callback."""
        self._trainer = trainer

    @property
    def attached(self) -> bool:
        """True once a Trainer has attached this callback (at the start of ``fit``, ``evaluate`` or ``predict``)."""
        return self._trainer is not None

    @property
    def trainer(self) -> "Trainer":
        """The Trainer whose loop calls this callback.

        Raises:
            RuntimeError: before a Trainer attached it.
        """
        if self._trainer is None:
            raise FailedPreconditionError(f"{type(self).__name__} is not attached to a Trainer yet; pass it to fit().")
        return self._trainer

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Receive ``fit``'s parameters: ``epochs``, ``steps``, ``global_batch_size``, ``num_replicas``."""
        self.params = dict(params)

    @property
    def model(self) -> "nn.Module":
        """The user's module (what ``strategy.unwrap`` returns), for reading or setting weights."""
        return self.trainer.unwrapped_model

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        """Called once at the start of ``fit``."""

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        """Called once at the end of ``fit`` (also after an early stop), with the last epoch's logs."""

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called at the start of each epoch (0-based ``epoch``)."""

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called at the end of each epoch with its reduced metrics (and validation metrics)."""

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called before each training step (``batch`` counts from 0 within the epoch)."""

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called after each training step with the running, reduced metrics of the epoch."""

    def on_test_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        """Called at the start of ``evaluate`` (and of the validation pass inside ``fit``)."""

    def on_test_end(self, logs: Mapping[str, Any] | None = None) -> None:
        """Called at the end of ``evaluate`` with its reduced metrics."""

    def on_test_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called before each evaluation batch."""

    def on_test_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called after each evaluation batch."""

    def on_predict_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        """Called at the start of ``predict``."""

    def on_predict_end(self, logs: Mapping[str, Any] | None = None) -> None:
        """Called at the end of ``predict``."""

    def on_predict_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called before each prediction batch."""

    def on_predict_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Called after each prediction batch."""


class CallbackList:
    """Call a hook on every callback, in order.

    Args:
        callbacks: ``towers.callbacks.Callback`` objects, called in this order.
        trainer: the Trainer each callback is attached to (``callback.trainer``).

    Raises:
        TypeError: an item that is not a callback (it lacks the hooks).
    """

    def __init__(self, callbacks: Iterable[Callback] = (), *, trainer: "Trainer | None" = None):
        self.callbacks: list[Callback] = []
        for cb in callbacks:
            if not all(callable(getattr(cb, hook, None)) for hook in ("on_epoch_end", "on_train_batch_end")):
                raise InvalidTypeError(
                    f"callbacks must be towers.callbacks.Callback instances. Received: {cb!r} "
                    f"({type(cb).__name__}). Subclass towers.callbacks.Callback.")
            self.callbacks.append(cb)
        if trainer is not None:
            for cb in self.callbacks:
                cb.set_trainer(trainer)

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Give every callback ``fit``'s parameters."""
        for cb in self.callbacks:
            cb.set_params(params)

    def __iter__(self):
        return iter(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook(*args)`` on every callback that has it."""
        if hook not in _HOOKS:
            raise user_error(f"Unknown callback hook. Expected one of {_HOOKS}", hook,
                             "Name one of these methods of towers.callbacks.Callback.")
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                method(*args)
