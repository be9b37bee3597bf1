"""DiLoCo's training state in a checkpoint: the global model, the outer optimizer's state and every worker's inner one.

Saved after an outer step (an epoch's end, or the step a preemption notice agreed on: every worker
holds the global values then), a DiLoCo job resumes as it would have gone on: the model is the
global one; the outer optimizer's state (DiLoCo's Nesterov momentum), which lives on the ps tasks,
is fetched from them with the ps tasks' own state requests (``ps_state.py``) and sent back on
restore; and each worker's inner optimizer state (Adam's moments differ from worker to worker) is
saved apart and restored into the same worker. All of it under the optimizer's entry, by
parameter name::

    {"state": ..., "param_groups": ...,           # the chief's inner state: loads into a plain optimizer
     "diloco": {"outer": {"state", "param_groups"},  # the ps tasks' outer optimizer
                "workers": [{"state", "param_groups"}, ...]}}  # each worker's inner optimizer
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn

from towers._logging import get_logger
from towers.checkpoint.state import optimizer_by_index, optimizer_by_name
from towers.strategies.parameter_server.diloco_optimizer import DiLoCoOptimizer

__all__ = ["DILOCO_KEY", "with_diloco_state", "split_diloco_state", "load_outer_state"]

log = get_logger(__name__)

#: Where a DiLoCo checkpoint keeps its outer optimizer's and workers' states, inside the optimizer's entry.
DILOCO_KEY = "diloco"


def with_diloco_state(state: dict[str, Any], *, model: nn.Module, optimizer: Any,
                      gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
    """Return ``state`` (a strategy's ``state_dict``) with the outer optimizer's and every worker's inner state added.

    A collective over the workers (``gather``: the strategy's ``all_gather_object``). ``state`` is returned as it
    is when ``optimizer`` is not a DiLoCo one or holds no state entry.

    Args:
        state: ``{"model", "optimizer", ...}``, the optimizer's entry by parameter name.
        model: the user's module (parameter names).
        optimizer: the prepared optimizer.
        gather: every live worker's value of an object, in worker order.

    Returns:
        ``state`` with ``state["optimizer"]["diloco"] = {"outer": ..., "workers": [...]}``.
    """
    inner = state.get("optimizer")
    if not isinstance(optimizer, DiLoCoOptimizer) or not isinstance(inner, Mapping):
        return state
    workers = gather(dict(inner))
    outer = optimizer_by_name(optimizer.outer_state_dict(), optimizer.outer, model)
    return {**state, "optimizer": {**inner, DILOCO_KEY: {"outer": outer, "workers": list(workers)}}}


def split_diloco_state(state: Mapping[str, Any], replica_id: int) -> tuple[dict[str, Any], Any]:
    """Return ``state`` with this worker's own inner optimizer state as its optimizer entry, and the outer state.

    A checkpoint without DiLoCo's entry comes back as it is, with None. A worker the checkpoint had no state
    for (a job resumed with more workers) takes the chief's.

    Args:
        state: what ``with_diloco_state`` returned (or any strategy's ``state_dict``).
        replica_id: this worker's index.

    Returns:
        ``(state for the strategy's load_state_dict, the outer optimizer's state by name or None)``.
    """
    saved = state.get("optimizer")
    if not isinstance(saved, Mapping) or DILOCO_KEY not in saved:
        return dict(state), None
    extra = saved[DILOCO_KEY]
    own = {k: v for k, v in saved.items() if k != DILOCO_KEY}
    workers = list(extra.get("workers") or [])
    if 0 <= replica_id < len(workers):
        own = dict(workers[replica_id])
    elif workers:
        log.info("the checkpoint holds the inner optimizer state of %d worker(s); worker %d resumes with the "
                 "chief's", len(workers), replica_id)
    return {**state, "optimizer": own}, extra.get("outer")


def load_outer_state(optimizer: Any, outer: Mapping[str, Any], model: nn.Module) -> None:
    """Send a saved outer optimizer state (by parameter name) to the ps tasks; a no-op for another optimizer.

    Raises:
        CheckpointError: the saved parameter names or groups differ from the outer optimizer's.
    """
    if isinstance(optimizer, DiLoCoOptimizer):
        optimizer.load_outer_state_dict(optimizer_by_index(outer, optimizer.outer, model))
