"""Pipeline parallelism on the mesh's ``pp`` dimension: one step's micro-batches through the stages, and its maths.

Each process of a pipeline holds one stage (``towers.strategies._pipeline_split``) and is given the
same batch (its replica's share, as tp processes are). A step cuts the batch into micro-batches
and runs torch's ``torch.distributed.pipelining`` schedule over them: ``"1f1b"`` (``Schedule1F1B``:
after a warm-up, each stage alternates one forward and one backward, so at most ``pp`` micro-batches'
activations are alive) or ``"gpipe"`` (``ScheduleGPipe``: every forward, then every backward).
Activations and their gradients go from stage to stage by send/recv (Gloo on the CPU, NCCL on GPUs).

The maths stays one device's. The last stage computes each micro-batch's loss with the user's
``loss_fn`` inside a replica context whose global batch size is the step's and whose micro-batches
are the update's (the step's accumulated batches times its micro-batches), so
``compute_average_loss`` divides the micro-batch's per-example SUM by the GLOBAL batch size (a
micro-batch's padding examples weigh zero). The schedule does not rescale (``scale_grads=False``):
the gradients of the micro-batches add up to the gradient of the step's loss, and FSDP2 over ``dp``
then sums the replicas' (``towers.strategies._fsdp``): one device's gradient of the global batch.
A loss normalised by weights (``compute_average_loss(per_token, weights=mask)``) backpropagates its
weighted SUM; the strategy divides every stage's gradient by the update's global weight once the
update's last schedule has run (``towers.strategies._pipeline_strategy``).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Mapping, NamedTuple

import torch

from towers._batch import whole
from towers._logging import get_logger
from towers.errors import user_error

__all__ = ["SCHEDULES", "check_schedule", "check_microbatches", "check_pipeline_options", "microbatches_for",
           "build_pipeline_mesh", "Pipeline", "PipelineComm", "StepResult"]

log = get_logger(__name__)

#: ``pp_schedule`` values and the torch schedule each names.
SCHEDULES = ("1f1b", "gpipe")


def check_schedule(value: Any) -> str:
    """Return ``pp_schedule`` in lower case.

    Raises:
        ValueError: a schedule towers does not run.
    """
    name = str(value).strip().lower()
    if name not in SCHEDULES:
        raise user_error("pp_schedule names a pipeline schedule towers runs", repr(value),
                         "Use pp_schedule='1f1b' (the default: less activation memory) or 'gpipe'.")
    return name


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


class PipelineComm:
    """The processes of this process's pipeline (the pp dimension at its dp, tp coordinate) and its last stage."""

    def __init__(self, group: Any, *, last_rank: int, stages: int, width: int = 1):
        self.group = group
        self.last_rank = last_rank  # global rank of this pipeline's last stage (it holds the losses)
        self.stages = stages
        self.width = width  # processes per stage (dp * tp): the next stage's process is this rank + width

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
        """Return every stage's ``obj`` (of this process's pipeline), in stage order."""
        import torch.distributed as dist

        from towers.process_group import collective

        parts: list[Any] = [None] * self.stages
        with collective("pipeline: the stages' parts"):
            dist.all_gather_object(parts, obj, group=self.group)
        return parts

    def gather_stages(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return every stage's ``state`` (keyed by original names) merged in stage order: the whole model's."""
        return {k: v for part in self.all_gather_object(state) for k, v in part.items()}


class StepResult(NamedTuple):
    """What one schedule over a step's micro-batches left on this stage (``Pipeline.step``)."""

    losses: list[torch.Tensor]  # what loss_fn returned for each micro-batch, detached, in order (the last stage's)
    outputs: Any  # the last stage's merged outputs; None on the others
    failure: Exception | None  # the first error loss_fn raised on the last stage (for every stage to raise)


class Pipeline:
    """This process's stage of a pipelined model and the schedules that run it (one per micro-batch shape)."""

    def __init__(self, stage_module: Any, *, comm: PipelineComm, device: torch.device, schedule: str,
                 microbatches: int):
        self.module = stage_module
        self.comm = comm
        self.device = device
        self.schedule_name = schedule
        self.microbatches = microbatches
        self._schedules: dict[tuple[Any, ...], tuple[Any, _Deferred]] = {}  # shape -> (schedule, its loss)
        stage_module.forward_without_backward = self.forward_without_backward

    def forward_without_backward(self, stage: Any, x: Any) -> torch.Tensor:
        """The whole model's output for ``x`` on every stage (``model(x)`` under ``torch.no_grad()``)."""
        import torch.distributed as dist

        from towers.strategies._pipeline_inference import forward_through_stages

        rank, index, comm = dist.get_rank(), stage.stage_index, self.comm
        return forward_through_stages(stage, x, stage.run_stage, group=comm.group, device=self.device,
                                      previous_rank=rank - comm.width if index > 0 else None,
                                      next_rank=rank + comm.width if index < stage.num_stages - 1 else None,
                                      last_rank=comm.last_rank)

    @property
    def is_last(self) -> bool:
        return bool(self.module.is_last)

    def _schedule(self, key: tuple[Any, ...], n: int, loss_fn: Callable[..., torch.Tensor]) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        cached = self._schedules.get(key)
        if cached is None:
            # A new shape gets its own stage (its receive buffers are sized at the first step); every stage of a
            # pipeline sees the same batch, so all of them build one at the same step.
            stage = PipelineStage(self.module, self.module.stage_index, self.module.num_stages, self.device,
                                  group=self.comm.group)
            kind = Schedule1F1B if self.schedule_name == "1f1b" and n >= self.module.num_stages else ScheduleGPipe
            if kind is not Schedule1F1B and self.schedule_name == "1f1b":
                log.info("pipeline: a share of %s example(s) runs %d micro-batch(es), fewer than the %d stages 1F1B "
                         "needs: this shape runs GPipe", key[1], n, self.module.num_stages)
            if len(self._schedules) >= 8:  # shapes seen once (a ragged last batch) do not pile up
                self._schedules.pop(next(iter(self._schedules)))
            deferred = _Deferred()
            cached = self._schedules[key] = (kind(stage, n, loss_fn=deferred, scale_grads=False), deferred)
        cached[1].target = loss_fn  # the step's loss (its replica contexts) on a cached schedule
        return cached[0]

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
            if not getattr(schedule, "_stage_backward_initialized", True):
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


class _Deferred:
    """The schedule's loss function, pointed at the step's own one (schedules are cached across steps)."""

    target: Callable[[Any, Any], torch.Tensor]

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        return self.target(output, target)


def _micro_context(context: Any, padding: int, global_batch: int | None, local: int, microbatches: int) -> Any:
    from towers.strategies.context import ReplicaContext

    strategy = context.strategy
    if global_batch is None and strategy.num_replicas_in_sync == 1:
        global_batch = local  # one replica, a batch without accounting: the share is the global batch
    # The update's gradient is the sum of every micro-batch's (the step's accumulated batches, each cut in
    # `microbatches`): a weighted loss cannot divide by its own micro-batch's weight, a regularization term added
    # in each is counted once per update.
    return ReplicaContext(strategy, global_batch_size=global_batch, num_padding_examples=padding,
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


def build_pipeline_mesh(spec: Any, device_type: str) -> tuple[Any, list[list[int]], int]:
    """Return the ``(pp, dp, tp)`` DeviceMesh, each (pp, tp) coordinate's dp group (global ranks), and the global
    rank of the last stage of this process's pipeline."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (spec.pp, spec.dp, spec.tp), mesh_dim_names=("pp", "dp", "tp"))
    width = spec.dp * spec.tp  # processes per stage
    groups = [[p * width + d * spec.tp + t for d in range(spec.dp)] for p in range(spec.pp) for t in range(spec.tp)]
    last_rank = (spec.pp - 1) * width + dist.get_rank() % width
    return mesh, groups, last_rank
