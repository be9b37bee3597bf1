"""The pipeline schedules towers runs, by name: which stages each process holds, what a shape falls back to, the bubble.

Every schedule ``torch.distributed.pipelining`` ships, under ``pp_schedule=``:

========================== ================================= ================ ======================================
name                       torch's schedule                  stages per rank  which stages process ``r`` holds
========================== ================================= ================ ======================================
``1f1b`` (default)         ``Schedule1F1B``                  1                ``r``
``gpipe``                  ``ScheduleGPipe``                 1                ``r``
``interleaved_1f1b``       ``ScheduleInterleaved1F1B``       2                ``r`` and ``r + pp`` (looped)
``looped_bfs``             ``ScheduleLoopedBFS``             2                ``r`` and ``r + pp`` (looped)
``interleaved_zero_bubble`` ``ScheduleInterleavedZeroBubble`` 2                ``r`` and ``r + pp`` (looped)
``zbv_zero_bubble``        ``ScheduleZBVZeroBubble``         2                ``r`` and ``2 pp - 1 - r`` (a V)
``dualpipe_v``             ``ScheduleDualPipeV``             2                ``r`` and ``2 pp - 1 - r`` (a V)
========================== ================================= ================ ======================================

A schedule with two stages per rank cuts the model into ``2 pp`` stages. Under a V the first and
the last stage are both on process 0 of the pipeline, so the losses and the model's outputs are
there. Some shapes a schedule cannot run: 1F1B needs at least ``pp`` micro-batches, DualPipeV at
least ``2 pp``, and the interleaved ones a count that divides into rounds of ``pp``
(``n % max(1, n // pp) == 0``). Such a step runs the schedule with the same stages that takes any
count (GPipe, LoopedBFS, ZBV), with a log line; nothing about the maths changes.

The bubble: the fraction of a step's time the processes of a pipeline sit idle. It is computed from
the per-rank action lists of the schedule torch builds (``pipeline_order``), by running them on a
clock where a forward takes 1, a backward 2 (its input part 1, its weight part 1), and an action
starts once its process is free and what it needs is done (the previous stage's forward of the same
micro-batch; the next stage's backward, or on the last stage its own forward; for a weight
gradient its input gradient). The fraction is the idle slots over all slots (processes x the step's
length). For 1F1B and GPipe this is (pp - 1) / (micro-batches + pp - 1). Sends and receives are
taken as free: what this measures is the schedule, not the link.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from towers.errors import InvalidArgumentError, user_error

__all__ = ["SCHEDULES", "ScheduleSpec", "check_schedule", "schedule_spec", "runnable_schedule", "build_schedule",
           "schedule_actions", "rank_actions", "bubble_fraction"]


class ScheduleSpec(NamedTuple):
    """One ``pp_schedule`` name: torch's class, how its stages sit on the ranks, and what takes a shape it cannot run."""

    name: str
    torch_name: str  # the class in torch.distributed.pipelining.schedules
    layout: str  # "single" (one stage per rank), "loop" (r, r + pp) or "v" (r, 2 pp - 1 - r)
    fallback: str | None  # the schedule with the same stages that runs any micro-batch count

    @property
    def stages_per_rank(self) -> int:
        return 1 if self.layout == "single" else 2

    def num_stages(self, pp: int) -> int:
        """The stages the model is cut into on a pipeline of ``pp`` processes."""
        return pp * self.stages_per_rank

    def stages_of(self, rank: int, pp: int) -> list[int]:
        """The stages pipeline rank ``rank`` holds, in order."""
        if self.layout == "single":
            return [rank]
        return [rank, rank + pp] if self.layout == "loop" else [rank, 2 * pp - 1 - rank]

    def rank_of(self, stage: int, pp: int) -> int:
        """The pipeline rank that holds ``stage``."""
        if self.layout != "v" or stage < pp:
            return stage % pp
        return 2 * pp - 1 - stage

    def refusal(self, microbatches: int, pp: int) -> str | None:
        """Why this schedule cannot run ``microbatches`` micro-batches on ``pp`` ranks (None: it can)."""
        stages = self.num_stages(pp)
        if self.name == "1f1b" and microbatches < stages:
            return f"1F1B needs at least as many micro-batches as stages ({stages})"
        if self.name == "dualpipe_v" and microbatches < stages:
            return f"DualPipeV needs at least as many micro-batches as stages ({stages})"
        rounds = max(1, microbatches // pp)
        if self.name.startswith("interleaved") and microbatches % rounds:
            return f"{self.torch_name} needs a micro-batch count that divides into rounds of pp={pp}"
        return None


_SPECS = (
    ScheduleSpec("1f1b", "Schedule1F1B", "single", "gpipe"),
    ScheduleSpec("gpipe", "ScheduleGPipe", "single", None),
    ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop", "looped_bfs"),
    ScheduleSpec("looped_bfs", "ScheduleLoopedBFS", "loop", None),
    ScheduleSpec("interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", "loop", "looped_bfs"),
    ScheduleSpec("zbv_zero_bubble", "ScheduleZBVZeroBubble", "v", None),
    ScheduleSpec("dualpipe_v", "ScheduleDualPipeV", "v", "zbv_zero_bubble"),
)
_BY_NAME = {spec.name: spec for spec in _SPECS}

#: ``pp_schedule`` values, the default first.
SCHEDULES = tuple(spec.name for spec in _SPECS)


def check_schedule(value: Any) -> str:
    """Return ``pp_schedule`` in lower case (``"ZBVZeroBubble"`` and ``"zbv-zero-bubble"`` are ``"zbv_zero_bubble"``).

    Raises:
        ValueError: a name that is none of torch's seven schedules.
    """
    name = str(value).strip().lower().replace("-", "_")
    aliases = {spec.torch_name.lower().removeprefix("schedule"): spec.name for spec in _SPECS}
    name = aliases.get(name.replace("_", ""), name)
    if name not in _BY_NAME:
        raise user_error("pp_schedule names a pipeline schedule towers runs", repr(value),
                         f"Use one of {', '.join(repr(n) for n in SCHEDULES)} ('1f1b', the default, keeps the least "
                         "activation memory of the one-stage-per-process schedules).")
    return name


def schedule_spec(name: str) -> ScheduleSpec:
    """The ``ScheduleSpec`` of a ``check_schedule``-d name."""
    return _BY_NAME[name]


def runnable_schedule(name: str, microbatches: int, pp: int) -> tuple[str, str | None]:
    """Return ``(the schedule that runs, why it is not `name`)`` for ``microbatches`` micro-batches on ``pp`` ranks:
    ``name`` itself with None, or its fallback (the same stages per rank) with the reason."""
    spec = _BY_NAME[name]
    reason = spec.refusal(microbatches, pp)
    if reason is None or spec.fallback is None:
        return name, None
    return spec.fallback, reason


def build_schedule(name: str, stages: list[Any], microbatches: int, loss_fn: Callable[..., Any] | None) -> Any:
    """Return torch's schedule ``name`` over this rank's ``stages`` (PipelineStage objects, in stage order), summing the
    micro-batches' gradients (``scale_grads=False``)."""
    from torch.distributed.pipelining import schedules

    spec = _BY_NAME[name]
    kind = getattr(schedules, spec.torch_name)
    held: Any = stages[0] if spec.layout == "single" else stages
    return kind(held, microbatches, loss_fn=loss_fn, scale_grads=False)


class _StageShape:
    """What torch's schedules read of a stage to lay out their actions (no module, no process group)."""

    def __init__(self, index: int, num_stages: int, pp: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_actions(name: str, pp: int, microbatches: int) -> dict[int, list[Any]]:
    """Return the compute actions of every pipeline rank for ``name`` (``check_schedule``-d) over ``microbatches``:
    the lists of the schedule torch builds, without a process group (``bubble_fraction`` reads them).

    Raises:
        ValueError: a count the schedule cannot run (``ScheduleSpec.refusal``).
    """
    import logging

    spec = _BY_NAME[name]
    reason = spec.refusal(microbatches, pp)
    if reason is not None:
        raise user_error(f"pp_schedule={name!r} on pp={pp} cannot run this many micro-batches: {reason}",
                         f"{microbatches} micro-batch(es)", "Use more micro-batches (pp_microbatches) or another schedule.")
    stages = [_StageShape(i, spec.num_stages(pp), pp) for i in range(spec.stages_per_rank)]
    quiet = logging.getLogger("torch.distributed.pipelining.schedules")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # torch logs "Using <schedule>" at INFO for each one built
    try:
        schedule = build_schedule(name, stages, microbatches, None)
    finally:
        quiet.setLevel(level)
    return rank_actions(schedule, name, pp, microbatches)


def rank_actions(schedule: Any, name: str, pp: int, microbatches: int) -> dict[int, list[Any]]:
    """Every pipeline rank's compute actions of a built torch ``schedule``, in the order the rank runs them.

    The multi-stage schedules run their ``pipeline_order`` as it is. Of the one-stage ones, GPipe's
    ``pipeline_order`` is what it runs; 1F1B's is a drawing that numbers the last stage's forwards
    from 1, so its actions are written here as ``Schedule1F1B`` runs them (``min(n, pp - s)`` forwards,
    then one backward and one forward, then the remaining backwards).
    """
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    if name == "1f1b":
        forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
        orders: dict[int, list[Any]] = {}
        for stage in range(pp):
            warmup = min(microbatches, pp - stage)
            actions = [_Action(stage, forward, m) for m in range(warmup)]
            for b in range(microbatches):
                actions.append(_Action(stage, backward, b))
                if warmup + b < microbatches:
                    actions.append(_Action(stage, forward, warmup + b))
            orders[stage] = actions
        return orders
    compute = {"F", "B", "I", "W", "OVERLAP_F_B"}
    return {rank: [a for a in actions if a is not None and a.computation_type.value in compute]
            for rank, actions in sorted(schedule.pipeline_order.items())}


_COST = {"F": 1, "I": 1, "W": 1, "B": 2}


def bubble_fraction(actions: dict[int, list[Any]], num_stages: int) -> float:
    """Return the idle fraction of a step run by ``actions`` (each rank's compute actions, in order) on ``num_stages``
    stages: the idle slots over all slots, a forward taking 1 slot and a backward 2 (module docstring).

    Raises:
        ValueError: actions that wait for each other (a schedule that cannot finish).
    """
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, micro-batch) -> when it ended
    free = {rank: 0 for rank in actions}
    busy = {rank: 0 for rank in actions}
    position = {rank: 0 for rank in actions}

    def needs(action: Any) -> list[list[tuple[int, str, int]]]:
        """What ``action`` waits for: each entry a list of which any one suffices."""
        stage, kind, micro = action.stage_index, action.computation_type.value, action.microbatch_index
        if kind == "F":
            return [] if stage == 0 else [[(stage - 1, "F", micro)]]
        if kind in ("B", "I"):
            if stage == num_stages - 1:
                return [[(stage, "F", micro)]]
            return [[(stage + 1, "B", micro), (stage + 1, "I", micro)]]
        return [[(stage, "I", micro), (stage, "B", micro)]]  # W

    def ready(parts: list[Any]) -> int | None:
        """When every part of an action can start (None: something it needs has not run yet)."""
        at = 0
        for part in parts:
            for any_of in needs(part):
                times = [done[key] for key in any_of if key in done]
                if not times:
                    return None
                at = max(at, min(times))
        return at

    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank, queue in actions.items():
            while position[rank] < len(queue):
                action = queue[position[rank]]
                parts = list(action.sub_actions) if action.sub_actions else [action]
                start = ready(parts)
                if start is None:
                    break
                clock = max(start, free[rank])
                for part in parts:  # an overlapped forward + backward runs its parts one after the other
                    kind = part.computation_type.value
                    clock += _COST[kind]
                    done[(part.stage_index, kind, part.microbatch_index)] = clock
                busy[rank] += clock - max(start, free[rank])
                free[rank] = clock
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {rank: str(queue[position[rank]]) for rank, queue in actions.items() if position[rank] < len(queue)}
            raise InvalidArgumentError(f"The schedule's actions wait for each other, so its bubble cannot be measured; "
                                       f"next on each rank: {stuck}. Report it with the schedule's name and sizes.")
    length = max(free.values())
    return 0.0 if length == 0 else 1.0 - sum(busy.values()) / (len(actions) * length)
