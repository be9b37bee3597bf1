"""What every strategy does with checkpoints and state dicts by default (a base class of ``Strategy``).

A strategy whose state lives elsewhere (shards, parameter servers) overrides ``state_dict``,
``load_state_dict``, ``full_state_dict`` and ``checkpoint_io``; the rest go through ``towers.checkpoint``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, cast

import torch
from torch import nn

from towers import checkpoint
from towers.checkpoint.api import load_plain_state_dict, plain_state_dict
from towers.checkpoint.layout import CheckpointIO

if TYPE_CHECKING:
    from towers.strategies.base import Strategy
    from towers.strategies.precision import Precision

__all__ = ["StrategyCheckpoints"]


class StrategyCheckpoints:
    """The checkpoint methods of ``Strategy`` (see there); ``Strategy`` supplies what they call."""

    if TYPE_CHECKING:  # defined by Strategy
        @property
        def precision(self) -> Precision: ...
        @property
        def is_chief(self) -> bool: ...
        def unwrap(self, model: nn.Module) -> nn.Module: ...
        def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Return ``{"model", "optimizer", "precision"}``: the training state of a prepared model and optimizer.

        The model's is the user's module's ``state_dict()`` (full tensors, or this process's shards
        as DTensors under a sharded strategy); the optimizer's is keyed by parameter NAME, not by
        torch's position, so it loads under any strategy. Plain tensors, numbers, strings, lists and
        dicts only. A collective where the state lives elsewhere (shards): every replica calls it.
        """
        return {**plain_state_dict(self.unwrap(model), optimizer), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Restore what ``state_dict`` returned (under this or another strategy) into a prepared model and optimizer.

        Every replica calls it. The optimizer loads first: torch checks its state before changing anything.
        """
        load_plain_state_dict(state, self.unwrap(model), optimizer)
        self.precision.load_state_dict(state.get("precision") or {})

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Return the user's module's full (unsharded) ``state_dict()``; a collective where it is sharded."""
        return self.unwrap(model).state_dict()

    def export_model(self, model: nn.Module, path: str | os.PathLike[str]) -> Any:
        """Write the user's module's full weights to ``path`` for inference (safetensors or a torch file); every replica calls it.

        The same as ``towers.checkpoint.export_model(model, path, strategy=cast("Strategy", self))``; returns the path.
        """
        return checkpoint.export_model(model, path, strategy=cast("Strategy", self))

    def checkpoint_io(self) -> CheckpointIO:
        """How this strategy's processes write checkpoint tensors (every process its part, by default)."""
        return self.__dict__.setdefault("_checkpoint_io", CheckpointIO(collective=True))

    def save_checkpoint(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
        """Write ``state`` (your dict: model, optimizer, data, values) as a checkpoint at ``path``; every replica calls it.

        The same as ``towers.checkpoint.save_checkpoint(path, state, strategy=cast("Strategy", self))``; any strategy restores it.
        """
        return str(checkpoint.save_checkpoint(path, state, strategy=cast("Strategy", self)))

    def restore_checkpoint(self, path: str | os.PathLike[str], objects: Mapping[str, Any]) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``objects`` (``{"model": model, ...}``) and return all it holds.

        The same as ``towers.checkpoint.restore_checkpoint(path, objects, strategy=cast("Strategy", self))``.
        """
        return checkpoint.restore_checkpoint(path, objects, strategy=cast("Strategy", self))

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Return the dict saved at ``path`` (tensors whole, on the CPU); every replica reads it."""
        return checkpoint.load_checkpoint(path, strategy=cast("Strategy", self))

    def checkpoint_exists(self, path: str | os.PathLike[str]) -> bool:
        """Return True when a complete checkpoint is published at ``path``."""
        return checkpoint.checkpoint_exists(path)

    def delete_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` and everything it holds; call it on the chief (nothing if absent)."""
        checkpoint.delete_checkpoint(path)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint in flight (if any) is written and visible at its path."""
        self.checkpoint_io().wait(is_chief=self.is_chief, broadcast_object=self.broadcast_object)
