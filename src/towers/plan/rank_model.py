"""One rank's share of a model under a parallel layout, on the meta device: its tp split and its pipeline stage.

``split_for_tp`` replaces each linear layer the model's tensor-parallel plan (``tp_plan_for``) splits
by this rank's share of it: a colwise layer keeps ``1/tp`` of its outputs (rows and bias), a rowwise
one ``1/tp`` of its inputs (columns; the bias whole), a gathered colwise head (``colwise_rep``) also
makes its whole output; everything else stays whole (replicated), as torch's tensor parallelism
leaves it. A step traced on that model holds what one tp rank holds. ``stage_modules`` cuts it into
the pipeline positions' modules (``split_model``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["Gathered", "split_for_tp", "stage_modules"]


class Gathered(nn.Module):
    """A colwise layer whose output is gathered (``colwise_rep``): this rank's slice, then the whole output."""

    def __init__(self, local: nn.Module, tp: int):
        super().__init__()
        self.local, self.tp = local, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return y.repeat(*([1] * (y.dim() - 1)), self.tp)


def _style_kind(style: Any) -> str:
    kind = style if isinstance(style, str) else type(style).__name__.lower().replace("parallel", "")
    return kind.removeprefix("conv1d_")


def split_for_tp(model: nn.Module, tp: int, plan: Any) -> None:
    """Replace, in place, each linear layer the tensor-parallel plan splits by this rank's share of it (on meta)."""
    from towers.parallel.tensor_parallel import check_divisible, matched_modules, tp_plan_for

    found = tp_plan_for(model, tp, plan)
    check_divisible(model, found, tp)
    for pattern, style in found.items():
        kind = _style_kind(style)
        if not kind.startswith(("colwise", "rowwise")):
            continue  # norms, layouts: replicated
        for name, module in matched_modules(model, pattern):
            if not isinstance(module, nn.Linear):
                continue  # other layers (Hugging Face's Conv1D) are counted whole: an overestimate
            bias = module.bias is not None
            with torch.device("meta"):
                if kind.startswith("colwise"):
                    local: nn.Module = nn.Linear(module.in_features, module.out_features // tp, bias=bias)
                    if kind in ("colwise_rep", "colwisereplicate"):
                        local = Gathered(local, tp)
                else:
                    local = nn.Linear(module.in_features // tp, module.out_features, bias=bias)
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, local)


def stage_modules(model: nn.Module, pp: int, schedule: str = "1f1b") -> list[nn.Module]:
    """The module each pipeline position holds under ``schedule`` (its stages, ``split_model``); ``[model]`` without pp."""
    if pp == 1:
        return [model]
    from towers.parallel.pipeline_schedules import schedule_spec
    from towers.parallel.pipeline_split import split_model

    spec = schedule_spec(schedule)
    return [split_model(model, spec.stages_of(p, pp), spec.num_stages(pp)) for p in range(pp)]
