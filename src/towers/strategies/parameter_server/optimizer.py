"""The optimizer ``ParameterServerStrategy.prepare`` returns: ``step()`` pushes gradients and pulls parameters.

It shares the user's optimizer's ``param_groups`` (the same dicts), so an LR scheduler built on
either object changes what the ps tasks use from the next step on. Its state lives on the ps
tasks; ``state_dict()``/``load_state_dict()`` fetch and send it in torch's own format (indices
as the user's optimizer numbers its parameters), so checkpoints load into a plain optimizer too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from towers.errors import UnimplementedError, user_error
from towers.strategies.parameter_server.embeddings import SparseTables
from towers.strategies.parameter_server.grad_guard import GradientGuard
from towers.strategies.parameter_server.ps_state import fetch_state, send_state
from towers.strategies.parameter_server.worker import BoundModel
from towers.verify_capture import before_update

__all__ = ["ParameterServerOptimizer", "prepared_optimizer"]


class ParameterServerOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer: ``step()`` = push gradients, ps applies them, pull fresh parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, bound: BoundModel | None, sparse: SparseTables | None = None,
                 step_batches: Callable[[], tuple[bool, list[Any]]] = lambda: (False, []),
                 finish_gradients: Callable[[], None] = lambda: None,
                 expected_gradient_changes: Callable[[], int] = lambda: 0,
                 replaced: Callable[[], bool] = lambda: False, updates_now: Callable[[], bool] = lambda: True):
        self._building = True
        self._updates_now = updates_now  # False on a micro-batch before the step's last (bitwise=True): no push
        self._replaced = replaced  # a later model was prepared: the ps tasks no longer hold this one
        self.optimizer = optimizer
        self._bound = bound
        self._sparse = sparse
        # (the step's batch had no example, the dispatched batches whose gradients this step pushes)
        self._step_batches = step_batches
        self._finish_gradients = finish_gradients  # weighted losses: divide by the update's global weight
        # Passing the user's group dicts makes both optimizers share them (torch keeps the dicts it is given).
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._building = False
        # p.grad is this worker's share: a clip measured on it (torch's clip_grad_norm_) is refused at the push.
        self._guard = GradientGuard((p for group in optimizer.param_groups for p in group["params"]),
                                    expected_gradient_changes)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Push this worker's gradients to the ps tasks and pull the updated parameters; return ``closure()``'s loss."""
        if not self._updates_now():
            return None  # bitwise=True: the step's later micro-batches are still to come; the push is after the last
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        if self._replaced():
            raise user_error(
                "ParameterServerStrategy holds one model at a time on its ps tasks, and a later strategy.prepare(...) "
                "replaced the model this optimizer steps: its gradients would be pushed to another model's shards",
                f"optimizer.step() of {type(self.optimizer).__name__} over the earlier model's parameters",
                "Train models that step together (a GAN's generator and discriminator) under HybridStrategy "
                "(--strategy hybrid: dense layers are summed among the workers, any number of models) or "
                "MirroredStrategy; under ParameterServerStrategy train one model after the other.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._guard.check()
        self._finish_gradients()
        if self._sparse is not None:
            self._sparse.push()
        empty, units = self._step_batches()
        if self._bound is not None:
            self._bound.push_pull(empty=empty, units=units)
        elif units and self._sparse is not None:  # no dense push reaches ps task 0: tell it apart
            self._sparse.client.batches_applied(units)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and those of the embedding rows looked up since the last step."""
        super().zero_grad(set_to_none)
        if self._sparse is not None:
            self._sparse.zero_grad()

    @property
    def versions(self) -> list[int]:
        """Each ps task's version (updates applied there) as of this worker's last push or pull."""
        return list(self._bound.versions) if self._bound is not None else []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the ps tasks' shards are fixed at ``prepare``."""
        if not self._building:
            raise UnimplementedError(
                "add_param_group after strategy.prepare() is not supported under ParameterServerStrategy: the ps "
                "tasks built their optimizers at prepare(). Add every param group before calling prepare().")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Return the ps tasks' optimizer state merged into torch's format (``state``, ``param_groups``)."""
        return fetch_state(self._bound, self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Send a state from ``state_dict()`` (or a plain optimizer of the same model) to the ps tasks.

        Raises:
            ValueError: when the groups or their sizes do not match this optimizer's.
        """
        send_state(self._bound, self.param_groups, state_dict)


def prepared_optimizer(strategy: Any, optimizer: torch.optim.Optimizer | None, bound: BoundModel | None,
                       sparse: SparseTables | None, *, diloco: Any, generation: int) -> torch.optim.Optimizer | None:
    """The optimizer ``strategy.prepare`` returns for the ``generation``-th model: DiLoCo's (inner steps here, outer
    ones at the ps tasks), else a ``ParameterServerOptimizer`` (under ``bitwise=True`` it pushes after the step's last
    micro-batch only); None without an optimizer.
    """
    if optimizer is None:
        return None
    replaced = lambda: strategy._generations.replaced(generation)  # noqa: E731
    if diloco is not None and bound is not None:
        return diloco.wrap(optimizer, bound, step_batches=strategy._take_step_batches, replaced=replaced)
    bitwise = strategy._bitwise
    return ParameterServerOptimizer(optimizer, bound, sparse, step_batches=strategy._take_step_batches,
                                    finish_gradients=strategy._finish_loss_weights,
                                    expected_gradient_changes=lambda: int(strategy._loss_weights.divided),
                                    replaced=replaced, updates_now=lambda: bitwise is None or bitwise.last)
