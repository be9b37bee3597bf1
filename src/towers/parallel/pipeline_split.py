"""Pipeline stages: which of a model's modules each stage holds, under their ORIGINAL names.

A process's stage module holds its share of the user's modules (the same objects, not copies)
at the names they have in the whole model: stage 1 of a 4-block GPT holds ``blocks.2``,
``blocks.3``, ``ln_f`` and ``head``, so its ``named_parameters()`` are ``blocks.2.attn.qkv.weight``,
..., ``head.weight``, as in the whole model. Checkpoints and comparisons with the one-device model
therefore need no renaming.

Schedules with two stages per process (``towers.parallel.pipeline_schedules``) cut the model
into ``2 pp`` stages, and one process's module holds both of its stages' parts (stages 0 and 2 of a
4-stage cut of a 4-block GPT: ``wte``, ``wpe``, ``blocks.0`` and ``blocks.2``), still under the
original names: one module, which FSDP2 shards, the optimizer points at and checkpoints save as
with one stage. torch's schedule gets one ``StageView`` per stage it holds: a module whose
parameters are that stage's and whose call runs that stage's modules through the process's module
(so FSDP2's hooks on it gather and free the parameters as with one stage).

Two kinds of models split:

- a model that declares its own cut, as towers' GPT does: ``towers_pipeline_units()`` (its
  ``(name, module)`` units in order; stages begin at a ``blocks.N`` unit) and a static
  ``towers_stage_forward(config, modules, x, first=, last=)`` (GPT: the embeddings and the first
  blocks on stage 0, the last blocks, ``ln_f`` and ``head`` on the last stage); the blocks balanced
  (earlier stages take the one extra block where they do not divide), or cut where ``pp_split`` says
  (``["blocks.2"]``).
- any ``nn.Sequential`` (its forward runs its entries in order): cut where ``pp_split`` names an
  entry (``"2"``, or ``"blocks.2"`` inside an entry that is itself an ``nn.Sequential`` /
  ``nn.ModuleList`` of blocks); without ``pp_split`` its top-level entries are balanced.

No torch.distributed here: the split is checked and built in one process (tests/unit).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch import nn

from towers.errors import FailedPreconditionError, user_error

__all__ = ["PipelineStageModule", "StageView", "split_model", "stage_bounds", "parse_split"]

_CALL_ERROR = (
    "A pipelined model (mesh {mesh}) cannot be called as model(x): this process holds stage {stage} of {stages} "
    "({names}), whose input comes from the previous stage and whose output goes to the next one, micro-batch by "
    "micro-batch. Expected one call that runs the whole pipeline schedule, forward and backward: "
    "loss, outputs = strategy.forward_backward(model, x, y, loss_fn) with loss_fn(outputs, y) returning "
    "towers.compute_average_loss(per_example_loss); then optimizer.step(). towers.Trainer.fit(..., loss=...) does "
    "this itself. Under torch.no_grad() (evaluation, prediction) model(x) runs the whole pipeline forward and returns "
    "its output on every stage; a model's own loss (Trainer without loss=) is not built under pipeline parallelism "
    "(docs/model_parallel.md, 'Pipeline parallelism').")


class PipelineStageModule(nn.Module):
    """This process's stages of a pipelined model: their share of the user's modules, under their original names.

    Called by the pipeline schedule only (``strategy.forward_backward``, through a ``StageView`` per
    stage); a direct call under ``torch.no_grad()`` runs the whole pipeline forward, and with
    gradients on raises the API to use instead.
    """

    def __init__(self, parts: Sequence[tuple[int, str, nn.Module]], *, num_stages: int,
                 stage_forward: Callable[..., torch.Tensor] | None = None, mesh: str = "pp"):
        super().__init__()
        self.stage_indices = sorted({stage for stage, _, _ in parts})  # the stages this process holds, in order
        self.stage_index, self.num_stages = self.stage_indices[0], num_stages
        self.module_names = [name for _, name, _ in parts]
        self._mesh_text = mesh
        #: ``(modules, x, first=, last=) -> output``: the model's own stage forward (its ``towers_stage_forward``), or
        #: None: the stage's modules run in order, each on the previous one's output (an ``nn.Sequential``)
        self._stage_forward = stage_forward
        self._parts: dict[int, list[tuple[str, nn.Module]]] = {s: [] for s in self.stage_indices}
        self.in_schedule = False  # set by the strategy around the schedule's step
        #: ``(stage, x) -> output``: the pipeline's forward without backward (set by the strategy), for model(x) under no_grad
        self.forward_without_backward: Callable[[Any, Any], torch.Tensor] | None = None
        for stage, name, module in parts:
            self._place(name, module)
            self._parts[stage].append((name, module))

    def _place(self, name: str, module: nn.Module) -> None:
        owner: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part) or not isinstance(getattr(owner, part), nn.Module):
                owner.add_module(part, nn.ModuleDict())
            owner = getattr(owner, part)
        owner.add_module(leaf, module)

    @property
    def is_first(self) -> bool:
        """Whether this process holds the first stage (it takes the model's input)."""
        return 0 in self._parts

    @property
    def is_last(self) -> bool:
        """Whether this process holds the last stage (it computes the losses)."""
        return self.num_stages - 1 in self._parts

    def stage_modules(self, stage: int) -> list[tuple[str, nn.Module]]:
        """The ``(original name, module)`` pairs of ``stage``, in the order they run."""
        return list(self._parts[stage])

    def forward(self, x: torch.Tensor, stage: int | None = None) -> torch.Tensor:
        """Run ``stage``'s modules on ``x`` (the schedule's micro-batch; ``stage`` None: the one stage held).

        Called directly under ``torch.no_grad()`` (evaluation, prediction), it runs the whole pipeline forward
        (``forward_without_backward``, set by the strategy) and returns the whole model's output on every stage;
        called directly with gradients on, it raises the API to use instead.
        """
        if self.in_schedule:
            return self.run_stage(x, stage)
        if not torch.is_grad_enabled() and self.forward_without_backward is not None:
            return self.forward_without_backward(self, x)
        names = ", ".join(self.module_names[:3]) + (", ..." if len(self.module_names) > 3 else "")
        held = " and ".join(str(s) for s in self.stage_indices)
        raise FailedPreconditionError(_CALL_ERROR.format(mesh=self._mesh_text, stage=held, stages=self.num_stages,
                                                         names=names))

    def run_stage(self, x: torch.Tensor, stage: int | None = None) -> torch.Tensor:
        """``stage``'s modules on ``x`` (None: the one stage held): the input of the stage (tokens on the first stage
        of a GPT)."""
        stage = self.stage_indices[0] if stage is None else stage
        if self._stage_forward is not None:
            return self._stage_forward(dict(self._parts[stage]), x, first=stage == 0, last=stage == self.num_stages - 1)
        for _, module in self._parts[stage]:
            x = module(x)
        return x


class StageView(nn.Module):
    """One stage of a ``PipelineStageModule`` as torch's ``PipelineStage`` takes it: its parameters are the stage's,
    and calling it runs the stage through the process's module (whose FSDP2 hooks then gather its parameters)."""

    def __init__(self, owner: PipelineStageModule, stage: int):
        super().__init__()
        self.stage_index = stage
        self.parts = nn.ModuleList(module for _, module in owner.stage_modules(stage))  # for .parameters()
        self.__dict__["_owner"] = owner  # not a child: its other stages' parameters are not this stage's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's output for ``x`` (within the schedule)."""
        return self.__dict__["_owner"](x, stage=self.stage_index)


def parse_split(value: "str | Sequence[str] | None") -> list[str] | None:
    """Return ``pp_split`` as a list of module names (``"blocks.2,blocks.4"`` or a list; None: balanced).

    Raises:
        TypeError: anything but a string or a sequence of strings.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return list(value)
    raise user_error("pp_split is a list of module names where stages begin", repr(value),
                     "Use e.g. pp_split=['blocks.2'] (--strategy-option pp_split=blocks.2).", cls=TypeError)


def stage_bounds(count: int, stages: int, what: str, per_rank: int = 1) -> list[int]:
    """Return where each stage begins among ``count`` blocks: balanced, the earlier stages take the extra ones
    (``per_rank``: stages each process holds, for the message).

    Raises:
        ValueError: fewer blocks than stages.
    """
    if count < stages:
        if per_rank == 1:
            raise user_error(f"Each of the pp={stages} pipeline stages needs at least one of the model's {what}",
                             f"{count} {what} for pp={stages}",
                             f"Use pp={max(1, count)} or fewer, or a model with at least {stages} {what}.")
        raise user_error(f"Each of the {stages} pipeline stages (pp={stages // per_rank}, {per_rank} per process) needs at "
                         f"least one of the model's {what}", f"{count} {what} for {stages} stages",
                         f"Use pp={max(1, count // per_rank)} or fewer, a schedule with one stage per process "
                         f"(pp_schedule='1f1b' or 'gpipe'), or a model with at least {stages} {what}.")
    size, extra = divmod(count, stages)
    return [i * size + min(i, extra) for i in range(stages)]


def _sequence_units(model: nn.Sequential, split: list[str] | None) -> list[tuple[str, nn.Module]]:
    """The entries of ``model`` in execution order; an entry named inside by ``split`` is opened into its blocks."""
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        opened = split is not None and any(s.startswith(f"{name}.") for s in split)
        if opened and isinstance(child, (nn.Sequential, nn.ModuleList)):
            units.extend((f"{name}.{sub}", m) for sub, m in child.named_children())
        else:
            units.append((name, child))
    return units


def _starts(units: list[tuple[str, nn.Module]], split: list[str] | None, stages: int, *,
            movable: list[int], model_name: str, per_rank: int) -> list[int]:
    """Index in ``units`` where each stage begins (``split``: the names given; else balanced over ``movable``)."""
    if split is None:
        what = "blocks" if model_name != "Sequential" else "top-level entries"
        bounds = stage_bounds(len(movable), stages, what, per_rank)
        return [0] + [movable[b] for b in bounds[1:]]
    names = [n for n, _ in units]
    if len(split) != stages - 1:
        example = [names[m] for m in movable[1:stages]]
        cut = f"pp={stages}" if per_rank == 1 else f"{stages} stages (pp={stages // per_rank}, {per_rank} per process)"
        raise user_error(f"pp_split names where stages 1..{stages - 1} begin: {stages - 1} module name(s) for {cut}",
                         f"{len(split)} name(s) {split}", f"Give {stages - 1} names, e.g. {example}.")
    starts = [0]
    for name in split:
        if name not in names or names.index(name) not in movable[1:]:
            raise user_error(f"pp_split names a block where a stage can begin in this {model_name}", repr(name),
                             f"Use one of {[names[m] for m in movable[1:]]}.")
        starts.append(names.index(name))
    if starts != sorted(set(starts)):
        raise user_error("pp_split's names must follow the model's order, each once", split,
                         "List where each stage begins, first to last.")
    return starts


def split_model(model: nn.Module, stage: "int | Sequence[int]", num_stages: int,
                split: "str | Sequence[str] | None" = None, *, mesh: str = "pp") -> PipelineStageModule:
    """Return stage ``stage`` of ``num_stages`` of ``model`` (or the stages ``stage`` lists, for schedules with several
    stages per process): a ``PipelineStageModule`` holding their modules under their original names.

    Raises:
        ValueError: a model towers cannot split (neither towers' GPT nor an ``nn.Sequential``), fewer blocks
            than stages, or a ``split`` that names no block where a stage can begin.
    """
    held = [stage] if isinstance(stage, int) else sorted(stage)
    names = parse_split(split)
    own = getattr(model, "towers_pipeline_units", None)  # a model that declares its own cut (towers' GPT)
    stage_forward = getattr(type(model), "towers_stage_forward", None) if callable(own) else None
    if callable(own) and stage_forward is not None:
        units = list(own())
        movable = [i for i, (n, _) in enumerate(units) if n.startswith("blocks.")]  # stages begin at a block
    elif isinstance(model, nn.Sequential):
        units = _sequence_units(model, names)
        movable = list(range(len(units)))
    else:
        raise user_error("Pipeline parallelism splits towers' GPT and nn.Sequential models (whose forward runs their "
                         "entries in order) into stages", f"a {type(model).__name__}",
                         "Write the model as nn.Sequential(embedding, *blocks, head) (each entry taking the previous "
                         "one's output, one tensor), or use a mesh without pp.")
    starts = _starts(units, names, num_stages, movable=movable, model_name=type(model).__name__,
                     per_rank=len(held))
    ends = [*starts[1:], len(units)]
    parts = [(s, name, module) for s in held for name, module in units[starts[s]:ends[s]]]
    forward = None if stage_forward is None else functools.partial(stage_forward, getattr(model, "config", None))
    return PipelineStageModule(parts, num_stages=num_stages, stage_forward=forward, mesh=mesh)
