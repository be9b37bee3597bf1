"""``parallelize``: how a model is laid out on a job's mesh, in one fixed order, for every strategy.

The order, and why:

1. **tensor, sequence and loss parallelism** on ``mesh.tp``: the layers the plan names are split
   first (``towers.parallel.tensor_parallel``), so what comes after sees the split modules: FSDP2
   then shards each split over dp (2-D), DDP all-reduces the local slices. The plan is the model's
   own (``towers_tp_plan``, ``base_model_tp_plan``) or the user's.
2. **activation checkpointing**: the repeated blocks recompute their activations in backward
   (``towers.parallel.activation_checkpointing``); forwards are replaced in place, so names and
   ``state_dict`` keys do not change and a checkpoint loads with it on or off.
3. **the data-parallel wrap**: FSDP2 on ``mesh.fsdp`` (``ShardOptions``), or the strategy's own
   wrapper handed in as ``wrap`` (DDP with towers' summing hook, a replica group's all-reduce).
4. **compile** comes after, in the strategy's ``prepare`` (``towers.parallel.compile``): the wrapped
   module is compiled, as PyTorch advises for DDP (Dynamo splits the graph at DDP's buckets, so the
   all-reduce still overlaps backward); compiling before the wrap would hide the buckets.

A pipeline cuts the model before this (each process parallelizes its own stage; see
``towers.parallel.pipeline``). Nothing here joins a process group or builds a mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from towers._logging import get_logger
from towers.parallel.activation_checkpointing import apply_activation_checkpointing
from towers.parallel.fsdp import ShardUnits, shard_model
from towers.parallel.layout import LayoutMesh
from towers.parallel.loss_parallel import gather_heads_outside, loss_parallel_plan
from towers.parallel.tensor_parallel import TPPlan, apply_tensor_parallel, tp_plan_for

__all__ = ["ParallelOptions", "ShardOptions", "parallelize"]

log = get_logger(__name__)


@dataclass(frozen=True)
class ShardOptions:
    """How FSDP2 shards a model over ``mesh.fsdp`` (see ``towers.parallel.fsdp.shard_model``)."""

    units: ShardUnits = "auto"
    reshard_after_forward: bool = True
    precision: str = "32"
    cpu_offload: bool = False


@dataclass(frozen=True)
class ParallelOptions:
    """What ``parallelize`` applies: a tensor-parallel plan and its variants, activation checkpointing, sharding."""

    tp_plan: TPPlan = "auto"
    sequence_parallel: bool = False  # the plan's sequence-parallel variant (its norms and dropout split too)
    loss_parallel: bool = False  # the vocabulary head's logits stay split for the loss
    activation_checkpointing: str = "off"
    shard: ShardOptions | None = None  # FSDP2 over mesh.fsdp; None: the strategy's own wrap, if any


def parallelize(model: nn.Module, mesh: LayoutMesh | None, options: ParallelOptions, *,
                wrap: Callable[[nn.Module], nn.Module] | None = None,
                sharded_logits: Callable[[], bool] = lambda: False) -> nn.Module:
    """Return ``model`` laid out on ``mesh`` as ``options`` say, in the module docstring's order (in place where torch
    is: tensor parallelism and FSDP2 swap parameters, checkpointing swaps forwards; ``wrap`` may return a wrapper).

    ``mesh`` None: one replica per process and no model parallelism (only checkpointing and ``wrap`` apply).
    ``sharded_logits()``: whether the caller wants the split logits (inside ``forward_backward`` under loss
    parallelism); outside, the loss-parallel head gathers them.

    Raises:
        ValueError: a plan that does not fit the model, an activation-checkpointing mode it cannot apply.
    """
    tp = None if mesh is None else mesh.tp
    if tp is not None:  # 1. split the layers first: FSDP2 then shards each split over dp
        plan, sequence_parallel = options.tp_plan, options.sequence_parallel
        if options.loss_parallel:
            plan = loss_parallel_plan(tp_plan_for(model, int(tp.size()), plan, sequence_parallel=sequence_parallel))
            sequence_parallel = False  # the plan is already its sequence-parallel variant where asked
        applied = apply_tensor_parallel(model, tp, plan, sequence_parallel=sequence_parallel)
        if options.loss_parallel and not gather_heads_outside(model, applied, sharded_logits):
            log.warning("loss_parallel=True has nothing to split in this %s: its plan splits no vocabulary head "
                        "(colwise_rep). The loss runs on whole logits.", type(model).__name__)
    model = apply_activation_checkpointing(model, options.activation_checkpointing)  # 2.
    if options.shard is not None and mesh is not None:  # 3. FSDP2 over the data-parallel dimensions
        shard = options.shard
        model = shard_model(model, mesh.fsdp, shard_units=shard.units, reshard_after_forward=shard.reshard_after_forward,
                            precision=shard.precision, cpu_offload=shard.cpu_offload)
    elif wrap is not None:  # 3. the strategy's own (DDP and its hooks)
        model = wrap(model)
    return model
