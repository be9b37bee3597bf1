"""What a ps task needs besides its loop: refusals sent back to the worker, the optimizer it rebuilds, state copies."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from towers.strategies.parameter_server.transport import Status

__all__ = ["RequestError", "build_optimizer", "clone_state"]


class RequestError(Exception):
    """A request the ps refuses; ``status`` tells the worker which exception to raise."""

    def __init__(self, message: str, status: int = Status.FAILED):
        super().__init__(message)
        self.status = status


def build_optimizer(spec: dict[str, Any] | None, params: Sequence[torch.nn.Parameter],
                    ps_index: int) -> torch.optim.Optimizer | None:
    """Rebuild the worker's optimizer over this shard: its class, ``defaults`` and per-group hyperparameters.

    Returns None when no optimizer was given or none of its groups has a parameter here.

    Raises:
        RequestError: when the class cannot be built from its defaults (sent back as bad input).
    """
    if spec is None or not spec["groups"]:
        return None
    groups = [{**hyper, "params": [params[i] for i in positions]} for hyper, positions in spec["groups"]]
    try:
        return spec["cls"](groups, **spec["defaults"])
    except Exception as exc:  # noqa: BLE001 - any constructor failure is the user's optimizer spec
        raise RequestError(
            f"ps task {ps_index} could not build {spec['cls'].__name__}(**{spec['defaults']}): {exc}. "
            "The ps rebuilds the optimizer from its class and its `defaults`; use an optimizer whose "
            "constructor accepts its defaults as keyword arguments.", Status.BAD_INPUT) from exc


def clone_state(state: Any) -> Any:
    """Deep-copy tensors of a state dict so it can be sent after the lock is released."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    return state
