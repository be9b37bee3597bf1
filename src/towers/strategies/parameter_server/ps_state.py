"""The optimizer state a ps task holds for its shard, fetched into torch's format and sent back.

``ParameterServerOptimizer`` (the ps tasks step the user's optimizer) and ``DiLoCoOptimizer`` (the ps
tasks step the outer optimizer) both checkpoint that state through here: one ``GET_STATE`` or
``SET_STATE`` request per ps task, indices as the optimizer behind ``param_groups`` numbers its
parameters (params in group order), so a saved state loads into a plain optimizer of the same model.
"""

from __future__ import annotations

from typing import Any, Sequence

from towers.errors import InvalidArgumentError
from towers.strategies.parameter_server.requests import hyperparameters
from towers.strategies.parameter_server.transport import Op
from towers.strategies.parameter_server.worker import BoundModel

__all__ = ["fetch_state", "send_state"]


def fetch_state(bound: BoundModel | None, param_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return the ps tasks' optimizer state for ``bound``'s model, merged into torch's format.

    Args:
        bound: the model the ps tasks hold (None: no dense parameters, an empty state).
        param_groups: the groups of the optimizer the ps tasks rebuilt (its hyperparameters are saved).

    Returns:
        ``{"state": {index: {...}}, "param_groups": [...]}``, as ``torch.optim.Optimizer.state_dict``.
    """
    state: dict[int, Any] = {}
    replies = bound.client.request(Op.GET_STATE, ps=bound.active) if bound is not None else []
    for p, reply in zip(bound.active if bound is not None else [], replies):
        if reply.meta is not None and bound is not None:
            for local, value in reply.meta["state"].items():
                state[bound.local_to_global[p][int(local)]] = value
    groups, index = [], 0
    for group in param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(index, index + n))})
        index += n
    return {"state": state, "param_groups": groups}


def send_state(bound: BoundModel | None, param_groups: Sequence[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """Send ``state_dict`` (from ``fetch_state`` or a plain optimizer of the same model) to the ps tasks.

    The saved groups' hyperparameters are copied into ``param_groups`` first.

    Args:
        bound: the model the ps tasks hold (None: only the hyperparameters are taken).
        param_groups: the groups of the optimizer the ps tasks rebuilt.
        state_dict: torch's format: ``state`` by index, ``param_groups``.

    Raises:
        ValueError: when the groups or their sizes do not match ``param_groups``.
    """
    saved = state_dict["param_groups"]
    sizes, saved_sizes = [len(g["params"]) for g in param_groups], [len(g["params"]) for g in saved]
    if sizes != saved_sizes:
        raise InvalidArgumentError(
            f"The optimizer state does not match this optimizer: expected param groups of sizes {sizes}, "
            f"received {saved_sizes}. Load a state saved from the same model and optimizer.")
    order = [i for g in saved for i in g["params"]]
    for group, saved_group in zip(param_groups, saved):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    if bound is None:
        return
    metas = []
    for p in bound.active:
        local_state = {}
        for local, global_index in enumerate(bound.local_to_global[p]):
            key = order[global_index]
            if key in state_dict["state"]:
                local_state[local] = state_dict["state"][key]
        local_groups, start = [], 0
        for g, (_, positions) in zip(bound.group_ids[p], bound.opt_groups[p]):
            hyper = hyperparameters(param_groups[g], f"param group {g}")
            local_groups.append({**hyper, "params": list(range(start, start + len(positions)))})
            start += len(positions)
        metas.append({"state": local_state, "param_groups": local_groups})
    bound.client.request(Op.SET_STATE, ps=bound.active, metas=metas)
