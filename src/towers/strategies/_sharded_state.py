"""The state of a sharded strategy (FSDP2): this rank's shards, the full state, and who writes checkpoints.

An object ``FullyShardedStrategy`` holds once its model is sharded (its own methods delegate to it): shards are DTensors keyed by
parameter name (``torch.distributed.checkpoint.state_dict``), so a state loads into a job of another
size, another mesh, or one plain process; with a pipeline each stage holds and loads its own part.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from towers.checkpoint.api import require_optimizer_state
from towers.checkpoint.layout import CheckpointIO
from towers.strategies._pipeline_strategy import StrategyPipeline
from towers.strategies.precision import Precision

__all__ = ["ShardedState", "raw_optimizer"]


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside the one ``prepare`` returned."""
    return getattr(optimizer, "optimizer", optimizer)


class ShardedState:
    """``state_dict``, ``load_state_dict``, ``full_state_dict`` and ``checkpoint_io`` over FSDP2's shards."""

    def __init__(self, *, precision: Precision, pipeline: StrategyPipeline | None, sharded: bool, async_save: bool):
        self._precision, self._pipeline = precision, pipeline
        self._sharded = sharded  # False: one process and no FSDP2 (checkpoint_io still writes as a collective)
        self._async_save = async_save

    # --- state and checkpoints ------------------------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        """Return ``{"model", "optimizer", "precision"}`` holding this rank's SHARDS (DTensors); a collective.

        Optimizer state is keyed by parameter name (``get_state_dict``), so it loads into a job
        of another size. ``export_model`` writes the full model for inference. With a pipeline: this
        stage's part, under the original names (its optimizer's groups name the whole model's parameters).
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None:
            model_state, optim_state = get_model_state_dict(model), None
        else:
            model_state, optim_state = get_state_dict(model, [raw_optimizer(optimizer)])
            if self._pipeline is not None:  # every stage's names
                optim_state = self._pipeline.whole_param_groups(optim_state, optimizer)
        return {"model": model_state, "optimizer": optim_state, "precision": self._precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
        """Restore a state from ``state_dict`` here, or a full one from any strategy, into the prepared model and optimizer.

        Shards (DTensors) load as they are; full tensors (from another strategy, or read whole)
        are cut into this process's shards. With a pipeline, each stage loads its own keys of the whole
        model's ``state``.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        from towers.checkpoint.state import is_dtensor

        require_optimizer_state(state, optimizer)
        state = state if self._pipeline is None else self._pipeline.stage_part(state, model)
        full = not any(is_dtensor(v) for v in state["model"].values())
        options = StateDictOptions(full_state_dict=full, strict=True)
        if optimizer is None or state.get("optimizer") is None:
            set_model_state_dict(model, state["model"], options=options)
        else:
            set_state_dict(model, [raw_optimizer(optimizer)], model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=options)
        self._precision.load_state_dict(state.get("precision") or {})

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Return the user's module's full state dict, gathered from every shard (and pipeline stage) onto the CPU (a
        collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self._pipeline is None:
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # With a pipeline every stage gathers its part (cpu_offload would give it to the job's rank 0 alone).
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        return self._pipeline.comm.gather_stages({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()})

    def checkpoint_io(self) -> CheckpointIO:
        """Every process writes its own shards; with ``async_save`` a background thread does, on a Gloo group of its own."""
        io = self.__dict__.get("_checkpoint_io")
        if io is None:
            group = None
            if self._sharded and self._async_save:
                # Asynchronous saves talk in a background thread: a group of their own, so they never
                # interleave with the training step's collectives.
                import torch.distributed as dist

                group = dist.new_group(backend="gloo")
            io = self.__dict__["_checkpoint_io"] = CheckpointIO(collective=True, process_group=group,
                                                                async_save=self._async_save,
                                                                gather_parts=None if self._pipeline is None
                                                                else self._pipeline.comm.all_gather_object)
        return io
