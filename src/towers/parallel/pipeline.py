"""Pipeline parallelism on the mesh's ``pp`` dimension: one step's micro-batches through the stages, and its maths.

Each process of a pipeline holds one stage, or two for the schedules that interleave them
(``towers.parallel.pipeline_split``), and is given the same batch (its replica's share, as tp
processes are). A step cuts the batch into micro-batches and runs the ``torch.distributed.pipelining``
schedule ``pp_schedule`` names over them: ``"1f1b"`` (``Schedule1F1B``: after a warm-up, each stage
alternates one forward and one backward, so at most ``pp`` micro-batches' activations are alive),
``"gpipe"`` (every forward, then every backward), or one of the five with two stages per process
(``towers.parallel.pipeline_schedules``: which stages each process holds, what a shape a
schedule cannot run falls back to, and the bubble). torch's schedule gets one ``PipelineStage``
per stage this process holds. Activations and their gradients go from stage to stage by send/recv
(Gloo on the CPU, NCCL on GPUs), or stay in the process where the next stage is its own.

The maths stays one device's. The last stage computes each micro-batch's loss with the user's
``loss_fn`` inside a replica context whose global batch size is the step's and whose micro-batches
are the update's (the step's accumulated batches times its micro-batches), so
``compute_average_loss`` divides the micro-batch's per-example SUM by the GLOBAL batch size (a
micro-batch's padding examples weigh zero). The schedule does not rescale (``scale_grads=False``):
the gradients of the micro-batches add up to the gradient of the step's loss, and FSDP2 over ``dp``
then sums the replicas' (``towers.parallel.fsdp``): one device's gradient of the global batch.
A loss normalised by weights (``compute_average_loss(per_token, weights=mask)``) backpropagates its
weighted SUM; the strategy divides every stage's gradient by the update's global weight once the
update's last schedule has run (``towers.strategies._pipeline_strategy``).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Mapping, NamedTuple

import torch

from towers._logging import get_logger
from towers.data._batch import whole
from towers.errors import user_error
from towers.parallel.pipeline_comm import PipelineComm, pipeline_comm
from towers.parallel.pipeline_schedules import (
    SCHEDULES,
    ScheduleSpec,
    bubble_fraction,
    build_schedule,
    check_schedule,
    rank_actions,
    runnable_schedule,
    schedule_actions,
    schedule_spec,
)
from towers.parallel.pipeline_split import StageView
from towers.parallel.pipeline_stages import HeldStages

__all__ = ["SCHEDULES", "check_schedule", "check_microbatches", "check_pipeline_options", "microbatches_for",
           "pipeline_comm", "Pipeline", "PipelineComm", "StepResult"]

log = get_logger(__name__)


def check_microbatches(value: Any, stages: int) -> int:
    """Return ``pp_microbatches`` as an int (None: one per stage).

    Raises:
        ValueError: not a positive integer.
    """
    if value is None:
        return stages
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or str(value).strip() != str(n):
        raise user_error("pp_microbatches must be a positive integer", repr(value),
                         f"Use e.g. pp_microbatches={stages} (one per stage, the default) or a multiple of it.")
    return n


def check_pipeline_options(spec: Any, shard_group_size: int | None, precision: str = "32") -> None:
    """Refuse, before the process group is joined, what pipeline parallelism does not build yet.

    Raises:
        ValueError: HSDP, fp16.
    """
    mesh = f"mesh {spec.describe()}"
    if precision == "fp16":
        raise user_error("fp16 does not combine with pipeline parallelism: its loss scaling needs the backward that "
                         "the pipeline's schedule runs itself", f"precision={precision!r}, {mesh}",
                         "Use precision='bf16' (no loss scaling) or '32' with pp.")
    if shard_group_size is not None:
        raise user_error("shard_group_size (HSDP) and a pipeline mesh cannot be combined yet",
                         f"shard_group_size={shard_group_size}, {mesh}", "Leave shard_group_size out with pp.")


def microbatches_for(local_batch_size: int, wanted: int) -> int:
    """The micro-batches a share of ``local_batch_size`` examples is cut into: ``wanted``, or the largest
    divisor of the share below it (the schedule's micro-batches have one shape)."""
    return max(m for m in range(1, min(wanted, max(local_batch_size, 1)) + 1) if local_batch_size % m == 0)


def _padding_in(micro: int, size: int, local: int, padding: int) -> int:
    """Padding examples (the share's trailing ``padding``) in micro-batch ``micro`` of ``size`` examples."""
    real = local - padding
    return max(0, min(size, (micro + 1) * size - max(real, micro * size)))


class StepResult(NamedTuple):
    """What one schedule over a step's micro-batches left on this stage (``Pipeline.step``)."""

    losses: list[torch.Tensor]  # what loss_fn returned for each micro-batch, detached, in order (the last stage's)
    outputs: Any  # the last stage's merged outputs; None on the others
    failure: Exception | None  # the first error loss_fn raised on the last stage (for every stage to raise)


class Pipeline:
    """This process's stages of a pipelined model and the schedules that run them (one per micro-batch shape)."""

    def __init__(self, stage_module: Any, *, comm: PipelineComm, device: torch.device, schedule: str,
                 microbatches: int):
        self.module = stage_module
        self.comm = comm
        self.device = device
        self.schedule_name = schedule
        self.spec: ScheduleSpec = schedule_spec(schedule)
        self.microbatches = microbatches
        self._schedules: dict[tuple[Any, ...], _Built] = {}  # one per micro-batch shape
        # One module per stage for torch's PipelineStage; with one stage per process, the stage module itself (so
        # torch sees the FSDP2 module it is and defers the gradients' reduce-scatter to the step's last backward).
        self._views = [stage_module] if self.spec.layout == "single" else [
            StageView(stage_module, index) for index in stage_module.stage_indices]
        #: The idle fraction of the last step's schedule (before the first step: the one ``microbatches`` runs).
        self.bubble_fraction = self._expected_bubble(microbatches)
        stage_module.forward_without_backward = self.forward_without_backward

    def forward_without_backward(self, stage: Any, x: Any) -> torch.Tensor:
        """The whole model's output for ``x`` on every stage (``model(x)`` under ``torch.no_grad()``)."""
        import torch.distributed as dist

        from towers.parallel.pipeline_inference import forward_through_stages

        return forward_through_stages(stage, x, stage.run_stage, group=self.comm.group, device=self.device,
                                      stage_ranks=self.comm.stage_ranks, rank=dist.get_rank())

    @property
    def is_last(self) -> bool:
        return bool(self.module.is_last)

    def _expected_bubble(self, n: int) -> float:
        name, _ = runnable_schedule(self.schedule_name, n, self.comm.stages)
        spec = schedule_spec(name)
        return bubble_fraction(schedule_actions(name, self.comm.stages, n), spec.num_stages(self.comm.stages))

    def _schedule(self, key: tuple[Any, ...], n: int, loss_fn: Callable[..., torch.Tensor]) -> Any:
        built = self._schedules.get(key)
        if built is None:
            # A new shape gets its own stages (their receive buffers are sized at the first step); every stage of a
            # pipeline sees the same batch, so all of them build one at the same step.
            pp, module = self.comm.stages, self.module
            held = HeldStages(module, self._views, device=self.device, group=self.comm.group)
            name, reason = runnable_schedule(self.schedule_name, n, pp)
            if reason is not None:
                log.info("pipeline: a share of %s example(s) runs %d micro-batch(es); %s: this shape runs %s", key[1][0],
                         n, reason, schedule_spec(name).torch_name)
            held.keep_gathered(name)
            if len(self._schedules) >= 8:  # shapes seen once (a ragged last batch) do not pile up
                self._schedules.pop(next(iter(self._schedules)))
            loss = _Deferred()
            schedule = build_schedule(name, held.stages, n, loss)
            bubble = bubble_fraction(rank_actions(schedule, name, pp, n), module.num_stages)
            if not self._schedules or reason is not None:  # the first step, and each shape that falls back
                log.info("pipeline: %s over %d micro-batch(es) on pp=%d (%d stage(s) per process): bubble %.3f of the "
                         "step (idle slots over all slots; a forward 1, a backward 2)", schedule_spec(name).torch_name,
                         n, pp, len(module.stage_indices), bubble)
            built = self._schedules[key] = _Built(schedule, loss, bubble, held)
        built.loss.target = loss_fn  # the step's loss (its replica contexts) on a cached schedule
        built.held.new_step()
        self.bubble_fraction = built.bubble
        return built.schedule

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             context: Any, enter: Callable[[Any], ContextManager[None]]) -> StepResult:
        """Run one step's forward and backward over every micro-batch; return what it left on this stage.

        ``losses`` are what ``loss_fn`` returned for each micro-batch, detached and in order, on the last
        stage (empty on the others: the strategy brings the step's loss to them); ``outputs`` the last
        stage's merged outputs (None on the others). An error of ``loss_fn`` (a refusal of towers' loss
        normalisers included) is not raised inside the schedule, where the other stages would wait for
        this one's gradients: its micro-batch and the rest backpropagate zero, and it comes back as
        ``failure`` for the strategy to raise on every stage. ``context`` is the step's replica
        context; ``enter(ctx)`` makes ``ctx`` current.

        Raises:
            ValueError: inputs that are not one tensor, an empty share.
        """
        if isinstance(inputs, tuple) and len(inputs) == 1:
            inputs = inputs[0]  # model(x) given as its positional arguments
        if not isinstance(inputs, torch.Tensor):
            raise user_error("Under pipeline parallelism the model's input is one tensor (batch first), which stage 0 "
                             "takes", f"inputs of type {type(inputs).__name__}",
                             "Pass x as one tensor: strategy.forward_backward(model, x, y, loss_fn).", cls=TypeError)
        local = int(inputs.shape[0])
        if local == 0:
            raise user_error("A pipeline step needs at least one example in this replica's share", "0 examples",
                             "Use strategy.distribute_dataset(..., pad_empty_batches=True) or drop_remainder=True.")
        n = microbatches_for(local, self.microbatches)
        if n != self.microbatches:
            log.info("pipeline: a share of %d example(s) does not divide into %d micro-batches: it runs %d",
                     local, self.microbatches, n)
        size = local // n
        padding = int(getattr(context, "num_padding_examples", 0) or 0)
        global_batch = getattr(context, "global_batch_size", None)
        losses: list[torch.Tensor] = []
        failures: list[Exception] = []

        def micro_loss(output: Any, target: Any) -> torch.Tensor:
            # A new schedule first runs the stage on placeholder tensors to learn the shapes it sends (torch's
            # metadata inference), loss included: that call is not a micro-batch, and the user's loss_fn never sees it.
            if not getattr(schedule, "_stage_backward_initialized", getattr(schedule, "_stages_backward_initialized", True)):
                return _placeholder_loss(output)
            i = len(losses)
            ctx = _micro_context(context, _padding_in(i, size, local, padding), global_batch, local, n)
            try:
                if failures:  # an earlier micro-batch's loss failed: the step is refused, loss_fn not called again
                    raise failures[0]
                with enter(ctx):
                    loss = loss_fn(output, target)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise user_error("loss_fn must return the loss to backpropagate (a scalar tensor), e.g. "
                                     "towers.compute_average_loss(per_example_loss)", _describe(loss),
                                     "Return compute_average_loss(loss_per_example) (one device's maths over "
                                     "micro-batches).")
            except Exception as exc:  # the schedule runs to its end on every stage; the strategy raises it on all
                if not failures:
                    failures.append(exc)
                loss = _placeholder_loss(output)
            losses.append(whole(loss.detach()))  # a loss-parallel loss is a DTensor
            return loss

        key = (n, tuple(inputs.shape), inputs.dtype, _shape(targets))
        schedule = self._schedule(key, n, micro_loss)
        self.module.in_schedule = True
        try:
            if self.module.is_first:
                outputs = schedule.step(inputs, target=targets if self.is_last else None)
            else:
                outputs = schedule.step(target=targets if self.is_last else None)
        finally:
            self.module.in_schedule = False
        return StepResult(losses, _detached(outputs) if self.is_last else None, failures[0] if failures else None)


class _Built(NamedTuple):
    """A schedule built for one micro-batch shape."""

    schedule: Any
    loss: "_Deferred"
    bubble: float  # its idle fraction (towers.parallel.pipeline_schedules.bubble_fraction)
    held: HeldStages


class _Deferred:
    """The schedule's loss function, pointed at the step's own one (schedules are cached across steps)."""

    target: Callable[[Any, Any], torch.Tensor]

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.target(output, target)


def _micro_context(context: Any, padding: int, global_batch: int | None, local: int, microbatches: int) -> Any:
    strategy = context.strategy
    if global_batch is None and strategy.num_replicas_in_sync == 1:
        global_batch = local  # one replica, a batch without accounting: the share is the global batch
    # The update's gradient is the sum of every micro-batch's (the step's accumulated batches, each cut in
    # `microbatches`): a weighted loss cannot divide by its own micro-batch's weight, a regularization term added
    # in each is counted once per update.
    return type(context)(strategy, global_batch_size=global_batch, num_padding_examples=padding,
                         accumulation_steps=context.accumulation_steps * microbatches,
                         is_update_step=context.is_update_step)


def _placeholder_loss(output: Any) -> torch.Tensor:
    """A scalar that depends on every floating tensor of ``output`` (its value unused: shapes are what is learnt)."""
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.stack([(t * 0).sum() for t in tensors]).sum()


def _shape(value: Any) -> Any:
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__


def _describe(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _detached(outputs: Any) -> Any:
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if isinstance(outputs, Mapping):
        return {k: _detached(v) for k, v in outputs.items()}
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_detached(v) for v in outputs)
    return outputs
