"""What code inside ``strategy.run`` knows about its step (``ReplicaContext``, ``current_replica_context()``,
``current_strategy()``), and the errors and checks every strategy shares: ``PeerLostError`` (a fault-tolerant
strategy lost a replica mid-step), ``check_max_norm``, ``accumulated_norm``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from towers.errors import InvalidArgumentError, TowersError

if TYPE_CHECKING:
    from towers.strategies.base import Strategy
    from towers.strategies.precision import Precision

__all__ = ["PeerLostError", "check_max_norm", "accumulated_norm", "ReplicaContext", "current_strategy",
           "current_replica_context", "CURRENT_STRATEGY", "CURRENT_REPLICA", "strategy_scope", "entered",
           "enter_until_next_step"]

#: The strategy whose ``scope()`` or ``run()`` encloses the code, and the replica context of the enclosing step.
CURRENT_STRATEGY: contextvars.ContextVar["Strategy | None"] = contextvars.ContextVar("towers_strategy", default=None)
CURRENT_REPLICA: contextvars.ContextVar["ReplicaContext | None"] = contextvars.ContextVar("towers_replica", default=None)


def current_strategy() -> "Strategy | None":
    """Return the strategy whose ``scope()`` or ``run()`` encloses this code, or None.

    Returns:
        The strategy, or None outside every ``scope()`` and ``run()``.

    Example:
        ```python
        import towers

        strategy = towers.OneDeviceStrategy("cpu")
        with strategy.scope():
            assert towers.current_strategy() is strategy
        assert towers.current_strategy() is None
        ```
    """
    return CURRENT_STRATEGY.get()


def current_replica_context() -> "ReplicaContext | None":
    """Return the replica context of the enclosing ``strategy.run``, or None outside one.

    Returns:
        The ``ReplicaContext`` of the step being run, or None outside ``strategy.run``.
    """
    return CURRENT_REPLICA.get()


@contextlib.contextmanager
def strategy_scope(strategy: "Strategy") -> Iterator[None]:
    """Make ``strategy`` the current strategy, restored on exit (``strategy.scope()``)."""
    token = CURRENT_STRATEGY.set(strategy)
    try:
        yield
    finally:
        CURRENT_STRATEGY.reset(token)


@contextlib.contextmanager
def entered(strategy: "Strategy", context: "ReplicaContext") -> Iterator[None]:
    """Make ``strategy`` the current strategy and ``context`` the current replica context, restored on exit."""
    strategy_token = CURRENT_STRATEGY.set(strategy)
    replica_token = CURRENT_REPLICA.set(context)
    try:
        yield
    finally:
        CURRENT_REPLICA.reset(replica_token)
        CURRENT_STRATEGY.reset(strategy_token)


def enter_until_next_step(strategy: "Strategy", context: "ReplicaContext") -> None:
    """Make ``context`` the current replica context (and ``strategy`` the current strategy) without a scope to leave.

    For a loop without ``strategy.run``: the step a prepared model's forward started lasts until the next one.
    """
    CURRENT_STRATEGY.set(strategy)
    CURRENT_REPLICA.set(context)


class PeerLostError(TowersError, RuntimeError):
    """A collective over the live replicas failed: one of them was lost since the current step began.

    Raised only by strategies that survive a lost replica (``FaultTolerantStrategy``): the caller
    may go on, since the next step's replicas leave the lost one out. Other strategies end the job.
    """


def check_max_norm(max_norm: Any) -> None:
    """Refuse a gradient-clipping bound that is not a positive finite number (torch clips everything to 0 then)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < math.inf:
        raise InvalidArgumentError(f"max_norm must be a positive finite number. Received: max_norm={max_norm!r}. Use the "
                                   "largest gradient norm you accept, e.g. 1.0; to not clip, do not call clip_grad_norm_.")


def accumulated_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float,
                     precision: Precision) -> torch.Tensor:
    """The norm of the gradient ``parameters`` accumulated so far on this replica (unscaled): what ``clip_grad_norm_``
    returns on a micro-batch that does not update (the update's last one clips the whole gradient)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).cpu()
                                                  for g in grads]), norm_type) if grads else torch.zeros(()))
    return norm / precision.scale if precision.needs_loss_scaling else norm


class ReplicaContext:
    """What code inside ``strategy.run`` knows about its step: replica id, replica count, global batch size.

    The strategy builds it for each step; code reads it with ``towers.current_replica_context()``. TF's
    names work too: ``replica_id_in_sync_group``, ``all_reduce``.

    Args:
        strategy: the strategy running the step (``replica_id`` and ``num_replicas_in_sync`` come from it).
        global_batch_size: the number of examples (over all replicas) whose mean gradient the next optimizer
            update takes: the global batch, or under gradient accumulation the sum of the update's
            micro-batches. It comes from the batch ``run`` was given (None when that batch did not come from
            ``distribute_dataset``).
        num_padding_examples: the trailing examples of this replica's batch that are padding (weight zero).
        accumulation_steps: the number of micro-batches in the current update (1 without accumulation).
        is_update_step: True on the last micro-batch of an update.
        gradient_shares: the backward passes, over every replica, whose gradients the update sums (default
            ``num_replicas_in_sync * accumulation_steps``; ``bitwise=True``: the update's micro-batches).
        until_next_step: marks the context a prepared model's forward outside ``run`` began: it lasts until
            the next step, of this strategy or of another one made later in the process.
    """

    def __init__(self, strategy: "Strategy", *, global_batch_size: int | None = None,
                 num_padding_examples: int = 0, accumulation_steps: int = 1, is_update_step: bool = True,
                 until_next_step: bool = False, gradient_shares: int | None = None):
        self.strategy = strategy
        self._gradient_shares = gradient_shares
        self.until_next_step = until_next_step
        self.replica_id = strategy.replica_id
        self.num_replicas_in_sync = strategy.num_replicas_in_sync
        self.global_batch_size = global_batch_size
        self.num_padding_examples = num_padding_examples
        self.accumulation_steps = accumulation_steps
        self.is_update_step = is_update_step

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index (tf.distribute's name for ``replica_id``)."""
        return self.replica_id

    def all_reduce(self, op: str, value: Any) -> torch.Tensor:
        """Return ``value`` combined across replicas with ``op`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``)."""
        return self.strategy.reduce(op, value)

    @property
    def gradient_shares(self) -> int:
        """The backward passes, over every replica, whose gradients the update sums: what
        ``scale_regularization_loss`` divides by so that the term counts once per update."""
        if self._gradient_shares is not None:
            return self._gradient_shares
        return self.num_replicas_in_sync * self.accumulation_steps

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id={self.replica_id}, num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"global_batch_size={self.global_batch_size}, num_padding_examples={self.num_padding_examples}, "
                f"accumulation_steps={self.accumulation_steps}, is_update_step={self.is_update_step})")
