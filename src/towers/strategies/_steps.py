"""Step bookkeeping shared by the synchronous strategies: update windows and the optimizer they wrap.

Gradient accumulation (``gradient_accumulation_steps=k``) keeps the user's script unchanged:
``strategy.run`` knows, from the batch ``distribute_dataset`` just yielded, whether this is the
last micro-batch of an update (every k-th batch, and the last batch of an epoch). Non-final
micro-batches run under DDP's ``no_sync()`` (no all-reduce); the optimizer returned by
``prepare`` makes ``step()`` a no-op on them and ``zero_grad()`` a no-op while gradients are
accumulating, so ``zero_grad(); loss.backward(); step()`` in any order just works.
Without ``distribute_dataset`` batches, every k-th ``run`` call is the last of an update.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from towers.data import BatchInfo

__all__ = ["StepTracker", "StrategyOptimizer"]


class StepTracker:
    """Knows, for the current ``run``, the update's global batch size, padding and whether gradients sync."""

    def __init__(self, accumulation_steps: int = 1):
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be a positive integer. Received: {accumulation_steps!r}. "
                "Use 1 for no accumulation.")
        self.accumulation_steps = accumulation_steps
        self.batch: BatchInfo | None = None
        self.sync = True  # whether the current run's backward all-reduces and the optimizer steps
        self._runs = 0  # runs since the last update, when no batch info is known

    def on_batch(self, info: BatchInfo | None) -> None:
        """Record the batch ``distribute_dataset`` just yielded (None when its iteration ended)."""
        self.batch = info

    def begin_run(self) -> tuple[int | None, int, int]:
        """Start a run; return ``(global_batch_size, num_padding_examples, accumulation_steps)`` for its context."""
        info = self.batch
        if info is not None:
            self.sync = info.last_in_update
            return info.examples_per_update, info.num_padding_examples, info.batches_per_update
        k = self.accumulation_steps
        self._runs = self._runs % k + 1
        self.sync = self._runs == k
        return None, 0, k


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare`` returns: steps only on the last micro-batch of an update, with fp16 loss scaling.

    Everything else (``param_groups``, ``state``, ``state_dict``, LR schedulers) is the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tracker: StepTracker, *,
                 scaler: torch.amp.GradScaler | None = None,
                 all_reduce_max: Callable[[torch.Tensor], None] | None = None,
                 before_step: Callable[[], None] | None = None):
        # Deliberately no super().__init__: this object is a view of `optimizer`, not a second optimizer.
        self.optimizer = optimizer
        self._tracker = tracker
        self._scaler = scaler
        self._all_reduce_max = all_reduce_max
        self._before_step = before_step
        self._accumulating = False
        self.last_step_skipped = False

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
        """Update the parameters on the last micro-batch of an update; otherwise keep accumulating."""
        if not self._tracker.sync:
            self._accumulating = True
            return None
        self._accumulating = False
        if self._before_step is not None:
            self._before_step()
        if self._scaler is None:
            self.last_step_skipped = False
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported with precision='fp16'. Call step() without a closure.")
        from towers.precision import scaler_step

        self.last_step_skipped = not scaler_step(self._scaler, self.optimizer, self._all_reduce_max)
        return None

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.optimizer!r})"
