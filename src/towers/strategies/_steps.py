"""Step bookkeeping shared by the synchronous strategies: update windows and the optimizer they wrap.

Gradient accumulation (``gradient_accumulation_steps=k``) keeps the user's script unchanged:
``strategy.run`` reads, from the batch it is given (every tensor ``distribute_dataset`` yields
carries its ``BatchInfo``), whether this is the last micro-batch of an update (every k-th batch,
and the last batch of an epoch). Non-final micro-batches run without gradient synchronisation;
the optimizer returned by ``prepare`` makes ``step()`` a no-op on them and ``zero_grad()`` a
no-op while gradients are accumulating, so ``zero_grad(); loss.backward(); step()`` in any order
just works. A ``run`` given no such batch counts: every k-th call is the last of an update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from towers.data import BatchInfo
from towers.errors import InvalidArgumentError
from towers.strategies.precision import Precision
from towers.verify_capture import before_update

__all__ = ["RunAccounting", "StepTracker", "StrategyOptimizer"]


@dataclass(frozen=True)
class RunAccounting:
    """What one ``strategy.run`` knows about its step, read from the batch it was given."""

    #: Examples (over all replicas) in the optimizer update this run belongs to; None when unknown.
    global_batch_size: int | None
    num_padding_examples: int
    accumulation_steps: int
    #: True when this run's backward synchronises gradients and the optimizer steps.
    sync: bool
    batch: BatchInfo | None


class StepTracker:
    """Decides, for each ``run``, the step's accounting from the batch it was given."""

    def __init__(self, accumulation_steps: int = 1):
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise InvalidArgumentError(
                f"gradient_accumulation_steps must be a positive integer. Received: {accumulation_steps!r}. "
                "Use 1 for no accumulation.")
        self.accumulation_steps = accumulation_steps
        self.sync = True  # whether the run in progress (or the last one) synchronises and steps
        self._runs = 0  # runs without a batch since the last update
        #: Runs started so far, and the batch of the last one: the step's identity, which the gradient
        #: all-reduce carries (``_step_check``). Plain attributes: DDP's hook may read them on autograd's thread.
        self.started = 0
        self.batch: BatchInfo | None = None

    def begin_run(self, info: BatchInfo | None) -> RunAccounting:
        """Start a run on a batch carrying ``info`` (None: a batch not from ``distribute_dataset``)."""
        self.started += 1
        self.batch = info
        if info is not None:
            self.sync = info.last_in_update
            return RunAccounting(info.examples_per_update, info.num_padding_examples, info.batches_per_update,
                                 self.sync, info)
        k = self.accumulation_steps
        self._runs = self._runs % k + 1
        self.sync = self._runs == k
        return RunAccounting(None, 0, k, self.sync, None)


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare`` returns: steps only on the last micro-batch of an update, with fp16 loss scaling.

    Everything else (``param_groups``, ``state``, ``state_dict``, LR schedulers) is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tracker: StepTracker, precision: Precision, *,
                 all_reduce_max: Callable[[torch.Tensor], None] | None = None,
                 before_step: Callable[[], None] | None = None,
                 finish_gradients: Callable[[], None] | None = None):
        # Deliberately no super().__init__: this object is a view of `optimizer`, not a second optimizer.
        self.optimizer = optimizer
        self._tracker = tracker
        self._precision = precision
        self._all_reduce_max = all_reduce_max
        self._before_step = before_step
        self._finish_gradients = finish_gradients  # weighted losses: divide by the update's global weight
        self._accumulating = False
        #: True when the last update was skipped (fp16: inf/NaN gradients on some replica).
        self.last_step_skipped = False
        #: Updates really applied (skipped fp16 steps and accumulating micro-batches do not count).
        self.iterations = 0

    # --- the wrapped optimizer's state --------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """Return the wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state dict."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    # --- stepping -----------------------------------------------------------------------------------
    @property
    def is_update_step(self) -> bool:
        """True when the current run is the last micro-batch of an update (``step()`` will update)."""
        return self._tracker.sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, unless micro-batches of the current update are still accumulating."""
        if not self._accumulating:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update the parameters on the last micro-batch of an update; otherwise keep accumulating.

        ``last_step_skipped`` says afterwards whether the update was skipped (fp16 inf/NaN) and
        ``iterations`` counts the updates applied.
        """
        if not self._tracker.sync:
            self._accumulating = True
            return None
        self._accumulating = False
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        if self._before_step is not None:  # the prepared model ran (its own, more precise error first)
            self._before_step()
        if self._finish_gradients is not None:
            self._finish_gradients()
        if closure is not None and not self._precision.needs_loss_scaling:
            self.last_step_skipped = False
            self.iterations += 1
            return self.optimizer.step(closure)
        stepped = self._precision.optimizer_step(self.optimizer, all_reduce_max=self._all_reduce_max, closure=closure)
        self.last_step_skipped = not stepped
        self.iterations += int(stepped)
        return None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.optimizer!r})"
