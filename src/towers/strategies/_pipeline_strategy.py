"""``strategy.pipeline``: what a strategy with a ``pp`` mesh does differently: the step, the values every stage sees,
the norm, checkpoints.

An object the sharded strategy holds when its mesh has a ``pp`` dimension (None without one); the
strategy's ``forward_backward``, ``reduce``, ``clip_grad_norm_``, loss-normaliser hooks and
checkpoints delegate to it. The mechanics of a stage (the split, the schedules, the sends) are
``towers.parallel.pipeline``'s; this is where they meet the strategy's step and loss accounting.

Losses normalised by weights (``compute_average_loss(per_token, weights=mask)``, and the Trainer's
loss that returns its batch's mean): the last stage computes each micro-batch's loss and notes its
weight; its gradient is the weighted SUM, and it reaches every stage through the schedule. When the
update's last ``forward_backward`` has run its schedule (FSDP2's reduce-scatter included), the last
stage's weight of the update (over its micro-batches and accumulated batches) travels to every stage
with the step's loss (one broadcast, which every step makes anyway), is summed over ``dp``, and every
stage divides its gradients by it: ``p.grad`` is one device's before ``forward_backward`` returns, as
the stage gradient guard notes it. The loss returned is what the same loss returns without a
pipeline: this replica's weighted mean over its share, divided by the update's shares.

Checkpoints: each stage's processes save the stage's part (FSDP2 shards over dp) under the original
names, the optimizer's parameter groups naming the whole model's parameters; the chief's manifest
lists every stage's tensors (``CheckpointIO.gather_parts``), so the union is the whole model's state
and loads into one process, another mesh or another pipeline; each stage reads only its own keys.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from towers.cluster.mesh import MeshSpec
from towers.data._batch import whole
from towers.errors import FailedPreconditionError, user_error
from towers.parallel.pipeline import Pipeline, PipelineComm, StepResult
from towers.parallel.pipeline_schedules import schedule_spec
from towers.parallel.pipeline_split import split_model
from towers.parallel.stage_gradients import StageGradientGuard
from towers.parallel.tensor_parallel import stage_plan
from towers.strategies._loss_weights import note_normalised
from towers.strategies.base import ReplicaContext, current_replica_context
from towers.strategies.context import check_max_norm

__all__ = ["StrategyPipeline"]


class StrategyPipeline:
    """The pipeline-parallel part of a synchronous strategy on a ``(pp, dp, tp)`` mesh, held as ``strategy.pipeline``."""

    def __init__(self, strategy: Any, *, spec: MeshSpec, comm: PipelineComm, pp_mesh: Any, tp_mesh: Any, split: Any,
                 schedule: str, microbatches: int, tp_plan: Any, sequence_parallel: bool,
                 dp_reduce: Callable[[str, Any], torch.Tensor]):
        self.strategy = strategy  # the strategy whose steps, loss weights and device this pipeline uses
        self.spec, self.comm, self.schedule, self.microbatches = spec, comm, schedule, microbatches
        self._pp_mesh, self._tp_mesh, self._split = pp_mesh, tp_mesh, split
        self._tp_plan, self._sequence_parallel = tp_plan, sequence_parallel
        self._dp_reduce = dp_reduce  # the strategy's reduce over the replicas of this stage (dp), not over the stages
        self.pipelines: list[Pipeline] = []  # this process's stage of each model prepare() split
        self._group_names: dict[int, list[list[str]]] = {}  # id(torch optimizer) -> each group's whole-model names
        any_stage = lambda flag: bool(comm.grad_norm(torch.tensor(float(flag)), float("inf")) > 0)  # noqa: E731
        #: Notices torch's own clip (any in-place change of p.grad) between forward_backward and the step.
        self.stage_grads = StageGradientGuard(spec.describe(), any_stage)

    @property
    def stage(self) -> int:
        """This process's pp coordinate (the stage it holds, or the first of the two it holds)."""
        return int(self._pp_mesh.get_local_rank())

    def keep_stage(self, model: nn.Module) -> tuple[nn.Module, Any, bool]:
        """Return this process's stage(s) of ``model`` (one module; its pipeline registered), the tensor-parallel plan
        for it and whether to derive that plan's sequence-parallel variant: the whole model's plan, for the modules it
        holds."""
        spec, comm = self.spec, self.comm
        layout = schedule_spec(self.schedule)  # which stages this pp coordinate holds: one, or two
        stage = split_model(model, layout.stages_of(self.stage, spec.pp), layout.num_stages(spec.pp),
                            self._split, mesh=spec.describe())
        for name in model.state_dict():  # gathered parts come back in the whole model's order
            comm.whole_order.setdefault(name, len(comm.whole_order))
        self.pipelines.append(Pipeline(stage, comm=comm, device=self.strategy.device, schedule=self.schedule,
                                       microbatches=self.microbatches))
        if self._tp_mesh is None:
            return stage, self._tp_plan, self._sequence_parallel
        plan = stage_plan(model, stage, int(self._tp_mesh.size()), self._tp_plan, sequence_parallel=self._sequence_parallel)
        return stage, plan, False  # the plan is already its sequence-parallel variant where asked

    @property
    def bubble_fraction(self) -> float | None:
        """The idle fraction of a step of the last prepared pipeline's schedule, from its actions (idle slots over all
        slots, a forward 1 slot, a backward 2): the last step's, or before the first step the one ``pp_microbatches``
        runs; None without a pipeline. See ``towers.parallel.pipeline_schedules``."""
        return self.pipelines[-1].bubble_fraction if self.pipelines else None

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Return ``(loss, outputs)`` after one forward and backward; with a pipeline, its schedule over the micro-batches.

        With a ``pp`` mesh every stage of the pipeline calls it with the same ``inputs`` and ``targets``:
        the last stage calls ``loss_fn`` once per micro-batch (``compute_average_loss`` there divides by
        the step's GLOBAL batch size, or with ``weights=`` by the update's global weight), ``loss`` reaches
        every stage (what ``loss_fn`` returns for the whole share without a pipeline: the micro-batches'
        sum, or their weighted mean), ``outputs`` only the last stage (None on the others).

        Raises:
            Exception: what ``loss_fn`` raised on the last stage (a refusal of towers' normalisers included),
                on every stage, after the schedule.
        """
        strategy = self.strategy
        if getattr(model, "_orig_mod", None) is not None:  # torch.compile(model): an OptimizedModule around it
            raise self._compile_refused("torch.compile(model) of the pipelined model")
        stage = strategy.unwrap(model)
        pipeline = next((p for p in self.pipelines if p.module is stage), None)
        if pipeline is None:
            raise user_error("strategy.forward_backward takes the model strategy.prepare returned",
                             f"a {type(model).__name__} this strategy did not prepare",
                             "Call model, optimizer = strategy.prepare(model, optimizer) first and pass that model.")
        context = current_replica_context()
        if context is None or context.until_next_step:  # a loop without strategy.run: its batch starts the step
            strategy._step_outside_run(model, (inputs, targets), {})
            context = current_replica_context() or ReplicaContext(strategy)
        weights = strategy._loss_weights
        micro_weights: list[float] = []  # the weight each micro-batch's loss noted (0: none)

        def weighed(output: Any, target: Any) -> torch.Tensor:
            before = weights.weight
            loss = loss_fn(output, target)
            micro_weights.append(weights.weight - before)
            return loss

        result = pipeline.step(inputs, targets, weighed, context=context, enter=strategy._entered)
        loss = self._finish_step(pipeline, result, micro_weights, update=context.is_update_step)
        self.stage_grads.note(stage.parameters())  # torch's own clip would change them before the step
        if not pipeline.is_last:
            note_normalised()  # the last stage normalised the loss whose gradient reached this stage
        return loss, result.outputs

    def _finish_step(self, pipeline: Pipeline, result: StepResult, micro_weights: list[float], *,
                     update: bool) -> torch.Tensor:
        """Return the step's loss on every stage; at an update's last step, divide every stage's gradients by the
        update's global weight where its losses were weighted.

        Raises:
            Exception: what ``loss_fn`` raised on the last stage, on every stage.
        """
        comm, weights = pipeline.comm, self.strategy._loss_weights
        # One broadcast from the last stage: the step's loss, whether the update is weighted, its weight so far, and
        # whether loss_fn failed there.
        shared = torch.zeros(4, dtype=torch.float64, device=self.strategy.device)
        if result.losses:
            shared[0] = _step_loss(result.losses, micro_weights).to(torch.float64)
            shared[1], shared[2] = float(weights.weighted), weights.weight
            shared[3] = float(result.failure is not None)
        shared = comm.from_last_stage(shared)
        weighted, weight, failed = shared[1:].tolist()  # (the clip and the step's checks wait for the device anyway)
        if failed:
            _raise_everywhere(comm, result.failure)
        if update:
            if weighted and not pipeline.is_last:  # the earlier stages' gradient is the last stage's weighted sum's
                weights.note_weighted(weight, last_micro_batch=True)
            dp_sum = self._dp_reduce  # the replicas of this stage: each brings its own pipeline's weight
            weights.finish(pipeline.module.parameters(), lambda total: dp_sum("sum", total), when="backward")
        return shared[0].to(torch.float32)

    # --- the loss normalisers' hooks: under pp the update ends with its last schedule, not a backward of its own ---
    def note_weighted_loss(self, weight: float) -> None:
        """Note a loss normalised by ``weight`` (``Strategy.note_weighted_loss``): its gradients are divided after the
        update's last schedule, on every stage (``forward_backward``)."""
        self.strategy._check_weighted_loss()
        self.strategy._loss_weights.note_weighted(weight, last_micro_batch=False)  # the update closes in forward_backward

    def compile_refused(self, received: str) -> Exception:
        """The error for ``torch.compile`` of a pipelined model (``received``: how it was asked)."""
        return self._compile_refused(received)

    def _compile_refused(self, received: str) -> Exception:
        # Measured: a compiled stage trained 0.4 off the plain loop in silence (the schedule runs the stage itself).
        mesh = self.spec.describe()
        return user_error(
            "torch.compile is not built for pipeline parallelism: torch's schedule runs each stage's modules "
            "micro-batch by micro-batch itself", f"{received} under mesh {mesh}",
            "Leave the model uncompiled under a pp mesh, or compile it on a mesh without pp (tensor parallelism, "
            "sharded or mirrored replicas), where prepare(..., compile=True) and torch.compile(model) both work.")

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` with the norm over every stage's gradients (torch's own sees one stage)."""
        check_max_norm(max_norm)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        strategy = self.strategy
        local = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=strategy.device)
        total = self.comm.grad_norm(whole(local), norm_type)
        if not strategy._updates_now():  # within an accumulation window: the norm so far; clip once, the whole gradient
            return total
        strategy._finish_loss_weights("clip")  # nothing left: forward_backward divided the update's gradients already
        coefficient = min(1.0, float(max_norm) / (float(total) + 1e-6))
        for grad in grads:
            grad.mul_(coefficient)
        self.stage_grads.note(params)  # towers' own change: the norm over every stage
        return total

    # --- checkpoints: each stage saves and loads its part, under the original names ------------------------
    def point_optimizer_at_stage(self, stage: nn.Module, optimizer: Any, names: dict[int, str]) -> None:
        """Keep this stage's parameters in each of ``optimizer``'s groups (``names``: the user's parameters' names);
        remember every group's WHOLE list of names, which checkpoints save (so they load into the whole model)."""
        raw = getattr(optimizer, "optimizer", optimizer)
        params = dict(stage.named_parameters())
        self._group_names[id(raw)] = [[names[id(p)] for p in g["params"] if id(p) in names] for g in raw.param_groups]
        for group in raw.param_groups:
            group["params"] = [params[names[id(p)]] for p in group["params"] if names.get(id(p)) in params]

    def whole_param_groups(self, optim_state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
        """``optim_state`` (this stage's) with each parameter group naming every stage's parameters, as the user's
        optimizer over the whole model does: the manifest then loads into one process as it is."""
        whole = self._group_names.get(id(getattr(optimizer, "optimizer", optimizer)))
        groups = optim_state["param_groups"]
        if whole is None or len(whole) != len(groups):
            return optim_state
        return {**optim_state, "param_groups": [{**g, "params": list(n)} for g, n in zip(groups, whole)]}

    def stage_part(self, state: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
        """The part of a whole model's ``state`` (``{"model", "optimizer", ...}``) this stage holds: its own names'
        entries; the other stages' (None where the checkpoint did not read them) are left out."""
        own = set(self.strategy.unwrap(model).state_dict())
        part = {**state, "model": {k: v for k, v in state["model"].items() if k in own}}
        optim = state.get("optimizer")
        if optim is not None:
            part["optimizer"] = {**optim, "state": {k: v for k, v in optim.get("state", {}).items() if k in own},
                                 "param_groups": [{**g, "params": [n for n in g["params"] if n in own]}
                                                  for g in optim["param_groups"]]}
        return part


def _step_loss(losses: list[torch.Tensor], micro_weights: list[float]) -> torch.Tensor:
    """The step's loss from its micro-batches': their sum, or where they are weighted (each the micro-batch's weighted
    mean over the update's shares) their weighted average times their count: the share's weighted mean, over its
    shares, as one loss over the whole share returns it."""
    total = float(sum(micro_weights))
    if total <= 0 or len(micro_weights) != len(losses):
        return torch.stack(losses).sum()
    stacked = torch.stack(losses).to(torch.float64)
    return (stacked * stacked.new_tensor(micro_weights)).sum() * (len(losses) / total)


def _raise_everywhere(comm: PipelineComm, failure: Exception | None) -> None:
    """Raise the last stage's ``failure`` there; on the other stages, its text as its nearest towers or builtin class
    (what every process can unpickle: a class of the user's may be defined where only the last stage sees it)."""
    said = None
    if failure is not None:
        kind = next(k for k in type(failure).__mro__ if k.__module__ in ("builtins", "towers.errors"))
        said = (kind, type(failure).__name__, str(failure))
    kind, name, text = comm.all_gather_object(said)[-1]
    if failure is not None:
        raise failure
    text = f"loss_fn raised {name} on this pipeline's last stage (global rank {comm.last_rank}): {text}"
    try:
        error = kind(text)
    except Exception:  # a class that takes other arguments
        error = FailedPreconditionError(text)
    raise error
