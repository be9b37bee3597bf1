"""The processes of one pipeline: its group, which process holds each stage, what they send each other outside a schedule.

A pipeline is the ``pp`` dimension of the ``(pp, dp, tp)`` mesh at this process's ``(dp, tp)``
coordinate. Its stages sit on its processes as the schedule says
(``towers.parallel.pipeline_schedules``: stage r on process r, or two stages per process, looped
or in a V), so the process holding the last stage, where the losses and the model's outputs are, is
the pipeline's last one or, under a V, its first. The collectives here are the ones a step makes
besides the schedule's sends: the last stage's values to every stage, the norm over the stages, the
stages' parts of a checkpoint gathered in the whole model's order.
"""

from __future__ import annotations

from typing import Any

import torch

from towers.parallel.pipeline_schedules import schedule_spec

__all__ = ["PipelineComm", "pipeline_comm"]


class PipelineComm:
    """The processes of this process's pipeline (the pp dimension at its dp, tp coordinate) and its last stage."""

    def __init__(self, group: Any, *, stage_ranks: list[int], stages: int, width: int = 1):
        self.group = group
        self.stage_ranks = stage_ranks  # global rank holding each stage of this pipeline, in stage order
        self.last_rank = stage_ranks[-1]  # global rank of this pipeline's last stage (it holds the losses)
        self.stages = stages  # processes of the pipeline (pp)
        self.width = width  # processes per pp coordinate (dp * tp)
        self.whole_order: dict[str, int] = {}  # the whole models' state_dict names, in their order (gather_stages)

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return the last stage's ``tensor`` on every stage of this pipeline (same shape everywhere)."""
        import torch.distributed as dist

        from towers.process_group import collective

        tensor = tensor.contiguous()
        with collective("pipeline: the last stage's value to the other stages"):
            dist.broadcast(tensor, src=self.last_rank, group=self.group)
        return tensor

    def grad_norm(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """Return the whole model's gradient norm from this stage's ``norm``: combined over the stages."""
        import torch.distributed as dist

        from towers.process_group import collective

        value = norm.detach().to(torch.float64).reshape(1).clone()
        with collective("clip_grad_norm_: the pipeline stages' gradient norms"):
            if norm_type == float("inf"):
                dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
                return value.reshape(()).to(norm.dtype)
            value = value ** norm_type
            dist.all_reduce(value, group=self.group)
        return (value ** (1.0 / norm_type)).reshape(()).to(norm.dtype)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every pipeline process's ``obj`` (of this process's pipeline), in pp order."""
        import torch.distributed as dist

        from towers.process_group import collective

        parts: list[Any] = [None] * self.stages
        with collective("pipeline: the stages' parts"):
            dist.all_gather_object(parts, obj, group=self.group)
        return parts

    def gather_stages(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return every stage's ``state`` (keyed by original names) merged in the whole model's order."""
        merged = {k: v for part in self.all_gather_object(state) for k, v in part.items()}
        last = len(self.whole_order)
        return dict(sorted(merged.items(), key=lambda item: self.whole_order.get(item[0], last)))


def pipeline_comm(mesh: Any, rank: int, schedule: str = "1f1b") -> PipelineComm:
    """Return global ``rank``'s pipeline on a ``LayoutMesh`` with a ``pp`` dimension: its group, and the rank holding
    each of its stages (``schedule``'s stages: one or two per pp coordinate)."""
    layout, spec = mesh.layout, schedule_spec(schedule)
    positions = [spec.rank_of(s, layout.pp) for s in range(spec.num_stages(layout.pp))]
    return PipelineComm(mesh.pp.get_group(), stage_ranks=layout.stage_ranks(rank, positions), stages=layout.pp,
                        width=layout.dp * layout.tp)
