"""The optimizer a FaultTolerantStrategy hands back: the user's, stepped only on a committed step."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from towers.errors import user_error
from towers.verify_capture import before_update

__all__ = ["FaultTolerantOptimizer"]

# strategy -> the job's step count right after its last commit vote: a second optimizer.step() before the next step
# begins would start a step of its own in the middle of the batch (two optimizers, one batch: a GAN's loop).
_voted_at: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


class FaultTolerantOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped only when every live group's all-reduce of this step succeeded."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, commit: Callable[[], bool],
                 updates_now: Callable[[], bool] = lambda: True) -> None:
        """``commit``: the strategy's commit vote of the step in progress (True: every live group's all-reduce succeeded);
        ``updates_now``: False on a micro-batch before the step's last (``bitwise=True``), where ``step()`` does nothing."""
        # No Optimizer.__init__: this object only forwards to the user's optimizer (torchft's OptimizerWrapper does the same).
        self.optimizer = optimizer
        self._commit = commit
        self._updates_now = updates_now

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise user_error("FaultTolerantStrategy's optimizer takes no closure", "a closure",
                             "Compute the loss and call backward before optimizer.step().", cls=TypeError)
        if not self._updates_now():
            return None  # bitwise=True: the step's later micro-batches still to come; the vote is after the last
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        strategy = getattr(self._commit, "__self__", None)
        if strategy is not None and not strategy.step_in_progress() and _voted_at.get(strategy) == strategy.current_step:
            raise user_error(
                "FaultTolerantStrategy commits one optimizer step per batch (its commit vote ends the job's step), and "
                "this batch's step has voted already", f"a second optimizer.step() ({type(self.optimizer).__name__}) "
                "in the same batch", "Train models that step together (a GAN's generator and discriminator) under "
                "MirroredStrategy or HybridStrategy, or step one optimizer over both models' parameters per batch.")
        committed = self._commit()
        if strategy is not None:
            _voted_at[strategy] = strategy.current_step
        if committed:
            return self.optimizer.step()
        return None
