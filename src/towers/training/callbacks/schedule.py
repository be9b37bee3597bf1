"""``LearningRateScheduler``: set the learning rate at the start of each epoch from ``schedule(epoch[, lr])``."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping

from towers._logging import get_logger
from towers.errors import InvalidArgumentError, InvalidTypeError
from towers.training.callbacks.base import Callback

__all__ = ["LearningRateScheduler"]

log = get_logger(__name__)


def _positional_arity(fn: Callable[..., Any]) -> tuple[int, int | None]:
    """Return (required, maximum) positional arguments of ``fn``; maximum None for ``*args``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: assume Keras's two arguments
        return 2, 2
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    return required, None if variadic else len(positional)


class LearningRateScheduler(Callback):
    """Set every parameter group's ``lr`` to ``schedule(epoch, lr)`` (or ``schedule(epoch)``) at each epoch start.

    ``schedule`` takes the epoch (0-based) and, if it accepts a second argument, the current
    learning rate, as Keras's ``LearningRateScheduler`` does: ``lambda epoch: 1e-3 * 0.9 ** epoch``
    and ``lambda epoch, lr: lr * 0.9`` both work. The same on every replica, since ``schedule``
    sees the same epoch and learning rate everywhere. The epoch logs carry the rate used as ``lr``.

    Args:
        schedule: takes the epoch (0-based) and, if it accepts a second argument, the current learning rate,
            and returns the new learning rate (a finite float >= 0).
        verbose: log each epoch's learning rate at INFO.

    Example:
        ```python
        from towers.callbacks import LearningRateScheduler

        decay = LearningRateScheduler(lambda epoch: 1e-3 * 0.9 ** epoch)
        ```

    Raises:
        TypeError: when ``schedule`` is not callable, or cannot take one or two positional arguments.
    """

    def __init__(self, schedule: Callable[..., float], *, verbose: bool = False):
        super().__init__()
        if not callable(schedule):
            raise InvalidTypeError(f"schedule must be a function schedule(epoch) or schedule(epoch, lr) returning the "
                                   f"learning rate. Received: {schedule!r}.")
        required, maximum = _positional_arity(schedule)
        if required > 2 or (maximum is not None and maximum < 1):
            raise InvalidTypeError(f"schedule must take the epoch and optionally the current learning rate: "
                                   f"schedule(epoch) or schedule(epoch, lr). Received: {schedule!r}, which takes "
                                   f"{required} required and at most {maximum} positional arguments. "
                                   "Example: LearningRateScheduler(lambda epoch: 1e-3 * 0.9 ** epoch).")
        self._takes_lr = maximum is None or maximum >= 2
        self.schedule = schedule
        self.verbose = verbose

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        optimizer = self.trainer.optimizer if self.attached else None
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            raise InvalidArgumentError("LearningRateScheduler needs an optimizer with param_groups (a torch.optim.Optimizer).")
        for group in groups:
            lr = self.schedule(epoch, float(group["lr"])) if self._takes_lr else self.schedule(epoch)
            try:
                lr = float(lr)
            except (TypeError, ValueError):
                lr = math.nan
            if not math.isfinite(lr) or lr < 0:
                args = f"epoch={epoch}, lr={group['lr']}" if self._takes_lr else f"epoch={epoch}"
                raise InvalidArgumentError(f"schedule({args}) must return a finite float >= 0. Received: {lr!r}.")
            group["lr"] = lr
        if self.verbose:
            log.info("epoch %d: learning rate %.6g", epoch + 1, float(groups[0]["lr"]))
