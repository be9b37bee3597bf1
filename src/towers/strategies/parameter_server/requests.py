"""What a ps task needs besides its loop: refusals sent back to the worker, the optimizer it rebuilds, state copies."""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch

from towers.errors import InvalidArgumentError, user_error
from towers.strategies.parameter_server.transport import Status

__all__ = ["RequestError", "build_optimizer", "clone_state", "hyperparameters", "optimizer_name", "optimizer_spec",
           "OPTIMIZERS", "REFUSED_OPTIMIZERS"]

#: torch.optim classes a ps task cannot run, with the reason and what to use instead.
REFUSED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "LBFGS calls its closure several times per step (a line search re-evaluates the model), and a ps "
             "task applies one pushed gradient per step: it cannot run the workers' model. Use a first-order "
             "optimizer (e.g. torch.optim.Adam), or train with LBFGS under MirroredStrategy, where every "
             "replica steps its own optimizer with the closure",
    "SparseAdam": "SparseAdam takes sparse gradients only, and the ps tasks receive dense ones. Use "
                  "torch.optim.Adam for dense parameters, and towers.ShardedEmbedding(..., optimizer='adam') "
                  "for embedding tables whose touched rows only are updated on the ps tasks",
}
#: The optimizers a ps task rebuilds, by name: every optimizer torch.optim exports, but those refused above.
#: A class travels as one of these names, never as code.
OPTIMIZERS: tuple[str, ...] = tuple(
    name for name, value in ((n, getattr(torch.optim, n, None)) for n in torch.optim.__all__)
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    and name not in REFUSED_OPTIMIZERS)


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """Return the name the ps tasks rebuild ``optimizer`` from.

    Raises:
        ValueError: its class is not one of ``OPTIMIZERS`` (a subclass, another library's optimizer, or a
            torch optimizer a ps cannot run: ``REFUSED_OPTIMIZERS``).
    """
    cls = type(optimizer)
    is_torch = getattr(torch.optim, cls.__name__, None) is cls
    if is_torch and cls.__name__ in REFUSED_OPTIMIZERS:
        raise user_error(f"ParameterServerStrategy cannot run torch.optim.{cls.__name__} on its ps tasks",
                         f"torch.optim.{cls.__name__}", REFUSED_OPTIMIZERS[cls.__name__] + ".")
    if is_torch and cls.__name__ in OPTIMIZERS:
        return cls.__name__
    raise InvalidArgumentError(
        f"ParameterServerStrategy rebuilds the optimizer on the ps tasks from its name, and a class cannot travel "
        f"(nothing sent to a ps is unpickled). Expected one of torch.optim.{', torch.optim.'.join(OPTIMIZERS)}. "
        f"Received: {cls.__module__}.{cls.__qualname__}. Use one of those (same hyperparameters), or MirroredStrategy "
        "for a custom optimizer.")


def optimizer_spec(optimizer: torch.optim.Optimizer,
                   groups: list[tuple[dict[str, Any], list[int]]]) -> dict[str, Any]:
    """Return what a ps task rebuilds ``optimizer`` from: its class name, its ``defaults`` and ``groups``.

    ``groups``: the shard's ``(hyperparameters, shard positions)`` per param group with a parameter there.

    Raises:
        ValueError: the class or a default cannot travel (``optimizer_name``, ``hyperparameters``).
    """
    return {"cls": optimizer_name(optimizer), "defaults": hyperparameters(optimizer.defaults, "defaults"),
            "groups": groups}


def hyperparameters(group: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Return ``group`` without ``params`` as values that can travel to a ps task (JSON numbers, no tensors).

    A one-element tensor (``lr=torch.tensor(0.01)``, tensor ``betas``) becomes its Python number: the
    ps steps on the CPU, where a tensor hyperparameter buys nothing, and the same number gives the
    same update. ``where`` names the group in errors (``"defaults"``, ``"param group 1"``).

    Raises:
        ValueError: a value that is neither JSON (None, bool, int, float, str, lists, tuples, dicts with
            string keys) nor a one-element tensor.
    """
    def convert(key: str, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            return value.item()
        if isinstance(value, (list, tuple)):
            return type(value)(convert(key, v) for v in value)
        if isinstance(value, dict) and all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: convert(key, v) for k, v in value.items()}
        shown = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                 else f"{type(value).__module__}.{type(value).__qualname__} {value!r}")
        raise user_error(
            f"The optimizer's {where} holds {key!r}, which cannot travel to the ps tasks: they rebuild the "
            "optimizer from JSON values (numbers, bools, strings, None, lists, tuples) and one-element tensors, "
            "and nothing sent to a ps is unpickled", shown,
            f"Set {key!r} to a number (or remove it from the group), or use MirroredStrategy, where the "
            "optimizer runs on the workers.")

    return {key: convert(key, value) for key, value in group.items() if key != "params"}


class RequestError(Exception):
    """A request the ps refuses; ``status`` tells the worker which exception to raise."""

    def __init__(self, message: str, status: int = Status.FAILED):
        super().__init__(message)
        self.status = status


def build_optimizer(spec: dict[str, Any] | None, params: Sequence[torch.nn.Parameter],
                    ps_index: int) -> torch.optim.Optimizer | None:
    """Rebuild the worker's optimizer over this shard: its class, ``defaults`` and per-group hyperparameters.

    The constructor gets only the ``defaults`` its signature takes (AdamW's ``defaults`` hold
    ``decoupled_weight_decay``, which ``AdamW()`` does not accept); every group keeps all its values.
    Returns None when no optimizer was given or none of its groups has a parameter here. It steps with torch's
    fused or foreach kernel (``use_fast_kernels``) unless the spec says ``exact`` (``bitwise=True``).

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
    defaults = spec.get("defaults")
    if not isinstance(defaults, dict):
        raise RequestError(f"ps task {ps_index} needs the optimizer's defaults as a dict. Received: "
                           f"{type(defaults).__name__}.", Status.BAD_INPUT)
    accepted = _keyword_names(cls)
    kwargs = {k: v for k, v in defaults.items() if accepted is None or k in accepted}
    try:
        groups = [{**hyper, "params": [params[i] for i in positions]} for hyper, positions in spec["groups"]]
        optimizer = cls(groups, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any constructor failure is the user's optimizer spec
        raise RequestError(
            f"ps task {ps_index} could not build torch.optim.{name}(**{kwargs}): {type(exc).__name__}: {exc}. "
            "The ps rebuilds the optimizer from its class, the defaults its constructor takes and each group's "
            "values; build the workers' optimizer with values its constructor accepts.", Status.BAD_INPUT) from exc
    if not spec.get("exact"):  # bitwise=True: torch's own choice, the kernel one device would step with
        use_fast_kernels(optimizer)
    return optimizer


def _keyword_names(cls: type) -> set[str] | None:
    """The keyword arguments ``cls(params, ...)`` takes; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                      inspect.Parameter.KEYWORD_ONLY)} - {"params"}


#: The optimizer settings that choose torch's kernels, not the maths: the ps tasks choose them.
KERNEL_KEYS = ("fused", "foreach")
def use_fast_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Make the ps's optimizer step in one fused kernel (or torch's foreach loop) where its groups left the
    choice to torch: the same maths as the worker's optimizer, several times faster on a CPU ps task.

    Optimizers whose constructor takes neither ``fused`` nor ``foreach`` (Muon) keep their own loop.
    """
    accepted = _keyword_names(type(optimizer)) or set()
    fast = {"fused": True} if "fused" in accepted else {"foreach": True} if "foreach" in accepted else None
    if fast is None:
        return
    for group in optimizer.param_groups:
        if all(group.get(k) is None for k in KERNEL_KEYS) or group.get("_towers_fast"):
            group.update(fast, _towers_fast=True)


def report_kernels(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an optimizer state dict) with the kernel choices ``use_fast_kernels`` made undone, as the user set them."""
    for group in state.get("param_groups", []):
        if group.pop("_towers_fast", False):
            group.update({k: None for k in KERNEL_KEYS if k in group})
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
