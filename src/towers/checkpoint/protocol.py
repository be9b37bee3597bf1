"""What checkpoints need from a strategy (``CheckpointStrategy``), and the one of a script that uses none.

``plain_state_dict``/``load_plain_state_dict`` are the state of a module that is not sharded, the
optimizer's keyed by parameter name (``state.py``); strategies whose state is a plain module's use them.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from torch import nn

from towers.checkpoint.checkpoint_io import CheckpointIO
from towers.checkpoint.state import CheckpointError, is_by_name, optimizer_by_index, optimizer_by_name

__all__ = ["CheckpointStrategy", "plain_state_dict", "load_plain_state_dict", "require_optimizer_state", "or_one_process"]


class CheckpointStrategy(Protocol):
    """What checkpoints need from a strategy (every ``towers.Strategy`` is one)."""

    @property
    def name(self) -> Any: ...
    @property
    def is_chief(self) -> bool: ...
    @property
    def num_replicas_in_sync(self) -> int: ...
    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None: ...
    def unwrap(self, model: nn.Module) -> nn.Module: ...
    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def checkpoint_io(self) -> CheckpointIO: ...
    def at_preemption_boundary(self) -> bool: ...


# --- one process without a strategy -------------------------------------------------------------------
def plain_state_dict(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Return ``{"model", "optimizer"}`` of a module that is not sharded: its state dict, the optimizer's by parameter name."""
    native = optimizer.state_dict() if optimizer is not None else None
    return {"model": model.state_dict(),
            "optimizer": optimizer_by_name(native, optimizer, model) if native is not None else None}


def load_plain_state_dict(state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
    """Load a ``plain_state_dict`` (or torch's own optimizer numbering) into ``model`` and ``optimizer``.

    The optimizer loads first: torch checks its state before changing anything.

    Raises:
        CheckpointError: an optimizer was given and ``state`` holds none for it.
    """
    require_optimizer_state(state, optimizer)
    saved = state.get("optimizer")
    if optimizer is not None and saved is not None:
        optimizer.load_state_dict(optimizer_by_index(saved, optimizer, model) if is_by_name(saved) else saved)
    model.load_state_dict(state["model"], strict=True)


def require_optimizer_state(state: Mapping[str, Any], optimizer: Any) -> None:
    """Refuse to load ``state`` into ``optimizer`` when it holds no optimizer state (nothing restored in part silently).

    Raises:
        CheckpointError: ``optimizer`` is given and ``state["optimizer"]`` is missing or None.
    """
    if optimizer is None or state.get("optimizer") is not None:
        return
    raise CheckpointError(
        f"The state to load holds no optimizer state (keys: {sorted(map(str, state))}), but an optimizer "
        f"({type(optimizer).__name__}) was given to fill: loading only the model would restart the optimizer from "
        "zero. Load it with optimizer=None if that is what you want (strategy.load_state_dict(state, model)), or save "
        "the state with its optimizer (strategy.state_dict(model, optimizer)).")


class _OneProcess:
    """The strategy of a script that uses none: one process, it is the chief."""

    name = "none"
    is_chief = True
    num_replicas_in_sync = 1

    def __init__(self) -> None:
        self._io = CheckpointIO(collective=True)

    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        return plain_state_dict(model, optimizer)

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
        load_plain_state_dict(state, model, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def checkpoint_io(self) -> CheckpointIO:
        return self._io

    def at_preemption_boundary(self) -> bool:
        return True


def or_one_process(strategy: CheckpointStrategy | None) -> CheckpointStrategy:
    """Return ``strategy``, or the strategy of one process (the chief) when it is None."""
    return strategy if strategy is not None else _OneProcess()
