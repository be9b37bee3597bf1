"""``LearningRateScheduler``: set the learning rate at the start of each epoch from ``schedule(epoch, lr)``."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from towers._logging import get_logger
from towers.training.callbacks.base import Callback

__all__ = ["LearningRateScheduler"]

log = get_logger(__name__)


class LearningRateScheduler(Callback):
    """Set every parameter group's ``lr`` to ``schedule(epoch, lr)`` at the start of each epoch (0-based).

    The same on every replica, since ``schedule`` sees the same epoch and learning rate everywhere.
    The epoch logs carry the rate used as ``lr``.
    """

    def __init__(self, schedule: Callable[[int, float], float], *, verbose: bool = False):
        super().__init__()
        if not callable(schedule):
            raise TypeError(f"schedule must be a function (epoch, lr) -> lr. Received: {schedule!r}.")
        self.schedule = schedule
        self.verbose = verbose

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        optimizer = self.trainer.optimizer if self.trainer is not None else None
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            raise ValueError("LearningRateScheduler needs an optimizer with param_groups (a torch.optim.Optimizer).")
        for group in groups:
            lr = self.schedule(epoch, float(group["lr"]))
            try:
                lr = float(lr)
            except (TypeError, ValueError):
                lr = math.nan
            if not math.isfinite(lr) or lr < 0:
                raise ValueError(f"schedule(epoch={epoch}, lr={group['lr']}) must return a finite float >= 0. "
                                 f"Received: {lr!r}.")
            group["lr"] = lr
        if self.verbose:
            log.info("epoch %d: learning rate %.6g", epoch + 1, float(groups[0]["lr"]))
