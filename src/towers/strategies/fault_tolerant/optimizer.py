"""The optimizer a FaultTolerantStrategy hands back: the user's, stepped only on a committed step."""

from __future__ import annotations

from typing import Any, Callable

import torch

from towers.errors import user_error
from towers.verify_capture import before_update

__all__ = ["FaultTolerantOptimizer"]


class FaultTolerantOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped only when every live group's all-reduce of this step succeeded."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, commit: Callable[[], bool]) -> None:
        """``commit``: the strategy's commit vote of the step in progress (True: every live group's all-reduce succeeded)."""
        # No Optimizer.__init__: this object only forwards to the user's optimizer (torchft's OptimizerWrapper does the same).
        self.optimizer = optimizer
        self._commit = commit

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
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        if self._commit():
            return self.optimizer.step()
        return None
