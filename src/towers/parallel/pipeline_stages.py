"""torch's ``PipelineStage`` objects for the stages one process holds, and how they meet FSDP2.

With one stage per process the stage module itself is torch's stage's module: it is the FSDP2
module, and torch's stage keeps the gradients' reduce-scatter for the step's last backward.

With two stages per process (``towers.parallel.pipeline_schedules``) one module holds both
stages' parts (``towers.parallel.pipeline_split``): FSDP2 shards it as one module, the optimizer
and checkpoints see it as one. torch's stage for each of them gets a ``StageView``, whose forward
runs that stage alone through the process's module (its FSDP2 hooks gather the parameters). The
backward and the step's gradient reduction of such a stage run on the process's module, the FSDP2
module torch's stage knows how to drive: the reduce-scatter waits for the step's last backward, and
in the schedules that split a backward into the input gradient and, later, the weight gradient
(the zero-bubble ones and DualPipeV) the weight gradient finds the parameters still gathered
(FSDP2 keeps them from a forward to the step's reduction there). The reduction, which frees every
stage's gathered parameters, runs once per step, after the last of the process's stages has run its
last backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["HeldStages", "SPLIT_BACKWARD"]

#: Schedules whose backward is split into the input gradient and, later, the weight gradient.
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v")


class HeldStages:
    """torch's stages for this process's stages of ``module`` (one per entry of ``views``), for one micro-batch shape."""

    def __init__(self, module: Any, views: list[Any], *, device: torch.device, group: Any):
        from torch.distributed.pipelining import PipelineStage

        shared = len(views) > 1 or views[0] is not module
        kind = _shared_module_stage() if shared else PipelineStage
        self.stages = [kind(view, index, module.num_stages, device, group=group)
                       for view, index in zip(views, module.stage_indices)]
        self._unreduced: set[int] = set()  # held stages whose last backward has not run yet in this step
        self._shared = module if shared else None
        if shared:
            for stage in self.stages:
                stage.owner, stage.peers = module, self

    def keep_gathered(self, schedule: str) -> None:
        """Before ``schedule`` first runs: where it splits the backward, FSDP2 keeps a stage's parameters gathered from
        its forward until the step's reduction (a weight gradient runs after other forwards)."""
        gathering = getattr(self._shared, "set_reshard_after_forward", None)  # an FSDP2 module's
        if schedule in SPLIT_BACKWARD and gathering is not None:
            gathering(False)

    def new_step(self) -> None:
        """Before a step: every held stage is still to run its last backward."""
        self._unreduced = {stage.stage_index for stage in self.stages}

    def last_backward_done(self, stage: int) -> bool:
        """Note that ``stage`` ran its last backward of the step; return whether it was the last held one to."""
        self._unreduced.discard(stage)
        return not self._unreduced


@functools.cache
def _shared_module_stage() -> type:
    """torch's ``PipelineStage`` for a ``StageView``: its backward and gradient reduction on the process's module."""
    from torch.distributed.pipelining import PipelineStage

    class SharedModuleStage(PipelineStage):
        owner: Any  # the process's module (an FSDP2 module under a pp mesh)
        peers: HeldStages

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict[str, Any],
                                       last_backward: bool = False) -> Any:
            view, self.submod = self.submod, self.owner
            try:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            finally:
                self.submod = view

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            if not self.peers.last_backward_done(self.stage_index):
                return  # another stage of this process still has backwards to run (its parameters stay gathered)
            view, self.submod = self.submod, self.owner
            try:
                super().perform_reduce_grad(grad_scale_factor)
            finally:
                self.submod = view

    return SharedModuleStage
