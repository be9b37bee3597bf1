"""What a ps task needs besides its loop: refusals sent back to the worker, the optimizer it rebuilds, state copies."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from towers.strategies.parameter_server.transport import Status

__all__ = ["RequestError", "build_optimizer", "clone_state", "optimizer_name", "OPTIMIZERS"]


#: The optimizers a ps task rebuilds, by name: a class travels as one of these names, never as code.
OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """Return the name the ps tasks rebuild ``optimizer`` from.

    Raises:
        ValueError: its class is not one of ``OPTIMIZERS`` (a subclass or another library's optimizer).
    """
    cls = type(optimizer)
    if cls.__name__ in OPTIMIZERS and getattr(torch.optim, cls.__name__) is cls:
        return cls.__name__
    raise ValueError(
        f"ParameterServerStrategy rebuilds the optimizer on the ps tasks from its name, and a class cannot travel "
        f"(nothing sent to a ps is unpickled). Expected one of torch.optim.{', torch.optim.'.join(OPTIMIZERS)}. "
        f"Received: {cls.__module__}.{cls.__qualname__}. Use one of those (same hyperparameters), or MirroredStrategy "
        "for a custom optimizer.")


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
    name = spec.get("cls")
    if name not in OPTIMIZERS:
        raise RequestError(f"ps task {ps_index} builds only torch.optim.{', '.join(OPTIMIZERS)}. Received: {name!r}.",
                           Status.BAD_INPUT)
    cls = getattr(torch.optim, name)
    try:
        groups = [{**hyper, "params": [params[i] for i in positions]} for hyper, positions in spec["groups"]]
        optimizer = cls(groups, **spec["defaults"])
    except Exception as exc:  # noqa: BLE001 - any constructor failure is the user's optimizer spec
        raise RequestError(
            f"ps task {ps_index} could not build {name}(**{spec['defaults']}): {exc}. "
            "The ps rebuilds the optimizer from its class and its `defaults`; use an optimizer whose "
            "constructor accepts its defaults as keyword arguments.", Status.BAD_INPUT) from exc
    use_fast_kernels(optimizer)
    return optimizer


#: The optimizer settings that choose torch's kernels, not the maths: the ps tasks choose them.
KERNEL_KEYS = ("fused", "foreach")
#: Optimizers with a fused CPU kernel (one pass over all parameters); the others loop with foreach.
_FUSED = ("SGD", "Adam", "AdamW", "Adagrad")


def use_fast_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Make the ps's optimizer step in one fused kernel (or torch's foreach loop) where its groups left the
    choice to torch: the same maths as the worker's optimizer, several times faster on a CPU ps task."""
    fast = {"fused": True} if type(optimizer).__name__ in _FUSED else {"foreach": True}
    for group in optimizer.param_groups:
        if all(group.get(k) is None for k in KERNEL_KEYS) or group.get("_towers_fast"):
            group.update(fast, _towers_fast=True)


def report_kernels(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an optimizer state dict) with the kernel choices ``use_fast_kernels`` made undone, as the user set them."""
    for group in state.get("param_groups", []):
        if group.pop("_towers_fast", False):
            group.update({k: None for k in KERNEL_KEYS})
    return state


def clone_state(state: Any) -> Any:
    """Deep-copy tensors of a state dict so it can be sent after the lock is released."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    return state
