"""``EarlyStopping`` and ``TerminateOnNaN``: stop every replica together, from reduced values."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from towers._logging import get_logger
from towers.errors import InvalidArgumentError
from towers.training.callbacks.base import Callback

__all__ = ["EarlyStopping", "TerminateOnNaN", "resolve_mode"]

log = get_logger(__name__)


def resolve_mode(mode: str, monitor: str) -> str:
    """Return ``"min"`` or ``"max"``: ``"auto"`` means max for accuracy-like names, min otherwise."""
    if mode not in ("auto", "min", "max"):
        raise InvalidArgumentError(f"mode must be 'auto', 'min' or 'max'. Received: {mode!r}.")
    if mode != "auto":
        return mode
    return "max" if any(word in monitor for word in ("acc", "auc", "precision", "recall", "f1")) else "min"


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    The monitored value comes from the epoch logs, already reduced across replicas, so every
    replica takes the same decision in the same epoch. With ``restore_best_weights`` the model
    gets the weights of the best epoch back when it stops (kept in CPU memory; not part of a
    backup, so after a restart it restores the best weights seen since the restart).

    Args:
        monitor: the epoch log to watch, e.g. ``"val_loss"`` or ``"val_accuracy"``.
        min_delta: the smallest change that counts as an improvement.
        patience: the epochs without improvement after which training stops.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` for accuracies, else ``"min"``).
        baseline: a value the monitored one must beat; until it does, epochs count against ``patience``.
        restore_best_weights: give the model the weights of the best epoch back when it stops.
        start_from_epoch: the epochs to wait before watching (a warm-up).

    Raises:
        ValueError: a ``patience`` that is not an integer >= 0.

    Example:
        ```python
        from towers.callbacks import EarlyStopping

        stop = EarlyStopping("val_loss", patience=3, restore_best_weights=True)  # trainer.fit(..., callbacks=[stop])
        ```
    """

    def __init__(self, monitor: str = "val_loss", *, min_delta: float = 0.0, patience: int = 0, mode: str = "auto",
                 baseline: float | None = None, restore_best_weights: bool = False, start_from_epoch: int = 0):
        super().__init__()
        if not isinstance(patience, int) or patience < 0:
            raise InvalidArgumentError(f"patience must be an integer >= 0. Received: {patience!r}.")
        self.monitor = monitor
        self.mode = resolve_mode(mode, monitor)
        self.min_delta = abs(float(min_delta))
        self.patience = patience
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = -1
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch = -1
        self.best_weights: dict[str, torch.Tensor] | None = None

    def _improves(self, value: float, reference: float) -> bool:
        if self.mode == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        self._reset()

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        current = (logs or {}).get(self.monitor)
        if current is None:
            if self.attached and self.trainer.strategy.is_chief:
                log.warning("EarlyStopping: %r is not in the epoch logs (available: %s); nothing to monitor",
                            self.monitor, sorted(logs or {}))
            return
        if epoch < self.start_from_epoch:
            return
        self.wait += 1
        if self._improves(float(current), self.best):
            self.best, self.best_epoch = float(current), epoch
            if self.restore_best_weights:
                self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            if self.baseline is None or self._improves(float(current), float(self.baseline)):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True
            if self.restore_best_weights and self.best_weights is not None:
                self.model.load_state_dict(self.best_weights)
            if self.trainer.strategy.is_chief:
                log.info("EarlyStopping: %s did not improve for %d epochs (best %.6g at epoch %d); stopping at epoch %d%s",
                         self.monitor, self.wait, self.best, self.best_epoch + 1, epoch + 1,
                         ", best weights restored" if self.restore_best_weights and self.best_weights is not None else "")

    def state_dict(self) -> dict[str, Any]:
        """Return ``wait``, ``best`` and ``best_epoch`` (saved by ``BackupAndRestore``)."""
        return {"wait": self.wait, "best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.wait, self.best, self.best_epoch = int(state["wait"]), float(state["best"]), int(state["best_epoch"])


class TerminateOnNaN(Callback):
    """Stop every replica as soon as the loss is NaN or infinite on any replica.

    The Trainer reduces a not-finite flag with every step (``logs["nonfinite_replicas"]``), so a
    NaN on one replica stops all of them after the same step. ``raise_error=True`` makes ``fit``
    raise ``FloatingPointError`` on every replica instead of returning.

    Args:
        raise_error: ``fit`` raises ``FloatingPointError`` on every replica instead of returning.
    """

    def __init__(self, *, raise_error: bool = False):
        super().__init__()
        self.raise_error = raise_error

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        logs = logs or {}
        bad = float(logs.get("nonfinite_replicas", 0.0))
        loss = float(logs.get("loss", 0.0))
        if bad == 0 and math.isfinite(loss):
            return
        strategy = self.trainer.strategy
        p = self.trainer.progress
        message = (f"TerminateOnNaN: the loss is not finite (loss {loss}) on {int(bad)} of "
                   f"{strategy.num_replicas_in_sync} replicas at epoch {p.epoch + 1}, batch {batch} "
                   f"(global step {p.global_step}); stopping every replica. Lower the learning rate, check the "
                   "input data for NaN/inf, or use gradient clipping.")
        if strategy.is_chief:
            log.error("%s", message)
        self.trainer.stop_training = True
        if self.raise_error:
            raise FloatingPointError(message)
