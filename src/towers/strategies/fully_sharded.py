"""FullyShardedStrategy: sharded data parallelism on FSDP2 (``fully_shard`` on a DeviceMesh), with DCP checkpoints.

Each process is one replica, as under ``MirroredStrategy``, and runs the same user script, but
holds only a 1/N shard of every parameter, gradient and optimizer state. FSDP2 all-gathers a
unit's parameters just before its forward (and again in backward), then frees them; gradients
are reduce-SCATTERED, so each rank keeps only its shard's gradient and the optimizer updates only
its shard. The reduction is a SUM, like Mirrored's all-reduce: losses are already divided by
the GLOBAL batch size, so the sum is one device's gradient of the global batch (same maths).

Cost against Mirrored: per step, one all-gather per unit in forward, one in backward (with
``reshard_after_forward=True``) and one reduce-scatter: about 1.5x Mirrored's bytes on the wire,
for parameters + gradients + optimizer state at ~1/N of Mirrored's per rank.

Checkpoints (``towers.checkpoint``) are sharded and atomic: each rank writes its shards, and a
job of another size or strategy reshards on load.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from towers._logging import get_logger
from towers.checkpoint.layout import CheckpointIO
from towers.cluster.info import ProcessInfo
from towers.cluster.mesh import MeshSpec, parse_mesh
from towers.cluster.strategy_options import parse_flag
from towers.data._batch import whole
from towers.errors import InvalidArgumentError
from towers.parallel.compile import compile_options
from towers.parallel.fsdp import ShardUnits, broadcast_from_first, select_units
from towers.parallel.layout import Layout, LayoutMesh
from towers.parallel.loss_parallel import loss_parallel_scope
from towers.parallel.parallelize import ParallelOptions, ShardOptions, parallelize
from towers.parallel.pipeline import (
    check_microbatches,
    check_pipeline_options,
    check_schedule,
    pipeline_comm,
)
from towers.parallel.pipeline_schedules import schedule_spec
from towers.parallel.pipeline_split import parse_split
from towers.parallel.tensor_parallel import TPPlan, tp_option
from towers.process_group import (
    DEFAULT_TIMEOUT_S,
    destroy_process_group,
    init_one_process_group,
    init_process_group,
)
from towers.strategies._bitwise import BitwiseSteps
from towers.strategies._bitwise_setup import bitwise_steps
from towers.strategies._bitwise_sharded import ShardedTree, bitwise_refusal
from towers.strategies._collectives import LocalComm, ProcessGroupComm, replica_comm
from towers.strategies._copies import refuse_copies
from towers.strategies._ddp import check_same_parameters
from towers.strategies._pipeline_strategy import StrategyPipeline
from towers.strategies._sharded_state import ShardedState, raw_optimizer
from towers.strategies._step_check import StepCheck, compare_before_step
from towers.strategies._steps import StepTracker
from towers.strategies._sync import SyncStrategy
from towers.strategies.precision import Precision, resolve_precision

__all__ = ["FullyShardedStrategy"]

log = get_logger(__name__)


def _replica_device(info: ProcessInfo) -> torch.device:
    from towers.devices import gpu_count

    return torch.device("cuda", info.local_rank) if gpu_count() >= info.local_world_size else torch.device("cpu")


class FullyShardedStrategy(SyncStrategy):
    """Sharded data parallelism: parameters, gradients and optimizer state split over the replicas (FSDP2).

    ``mesh`` adds tensor parallelism (``"dp=2,tp=2"``: the ``tp`` processes of one replica split its layers by
    ``tp_plan`` and see the same batch, FSDP2 shards each split layer over ``dp``) and pipeline parallelism
    (``"pp=2,dp=2"``, outermost: each process holds a stage, ``strategy.forward_backward`` runs the schedule);
    ``num_replicas_in_sync`` is then ``dp``. See the model parallelism docs, ``towers.parallel.tensor_parallel``
    and ``towers.parallel.pipeline``.

    Args:
        info: this process's place in the job. Default: read from the environment.
        timeout_s: the deadline of every collective, in seconds.
        backend: ``"auto"`` (NCCL on GPUs, Gloo on CPUs), ``"nccl"`` or ``"gloo"``.
        precision: ``"32"``; ``"bf16"`` / ``"fp16"``: FSDP2's ``MixedPrecisionPolicy``, parameters gathered
            and computed in that dtype, gradients reduced in float32 into float32 master shards; fp16 also
            scales the loss in ``strategy.backward``.
        gradient_accumulation_steps: micro-batches per optimizer update.
        shard_units: which submodules are FSDP units: ``"auto"`` = each repeated block of the model's
            ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``, logged at INFO, else by size with a
            warning; a module class or tuple of classes; or a parameter count.
        reshard_after_forward: free gathered parameters after forward and gather again in backward (less
            memory, one more all-gather).
        cpu_offload: parameter shards, gradients and optimizer state live in host memory (for GPUs).
        shard_group_size: HSDP: shard within groups of this many processes, replicate across groups, as
            ``mesh="dp_replicate=R,dp_shard=S"`` says too. Default: the processes per node when the job
            spans several nodes, else all.
        async_save: checkpoints written by a background thread.
        mesh: a device mesh such as ``"dp=2,tp=2"`` or ``"pp=2,dp=2"``. Default: every process a replica.
        tp_plan: how a tp mesh splits the model: ``"auto"`` (towers' GPT and Hugging Face models with a
            ``base_model_tp_plan``), or a dict / callable (see ``towers.parallel.tensor_parallel``).
        sequence_parallel: also split what the plan leaves whole on the sequence over ``tp``.
        loss_parallel: keep the vocabulary head's logits split over ``tp`` for the loss.
        pp_split: module names where pipeline stages 1.. begin. Default: balanced.
        pp_schedule: the pipeline schedule, one of torch's seven (``"1f1b"``, ``"gpipe"``, ...).
        pp_microbatches: micro-batches per pipelined step. Default: one per stage.
        bitwise: the same bits at any replica count (``micro_batch_size`` optional; plain sharding over every process:
            no tp, pp or HSDP mesh, no ``cpu_offload``): the tree is summed in FSDP2's reduce-scatter.
        micro_batch_size: the examples of one micro-batch under ``bitwise=True``.

    Raises:
        ValueError: an option out of range or refused with another (the message names the fix), before the
            process group is joined.

    Example:
        <!-- not-run: a job of several processes: towers launch --nproc-per-node 4 --strategy sharded train.py -->
        ```python
        import towers

        strategy = towers.FullyShardedStrategy(mesh="dp_replicate=2,dp_shard=2", precision="bf16")
        model, optimizer = strategy.prepare(build_model(), build_optimizer)  # each block its own FSDP unit
        ```
    """

    name = "sharded"

    def __init__(self, *, info: ProcessInfo | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str = "auto", precision: "str | int | Precision | None" = "32", gradient_accumulation_steps: int = 1,
                 shard_units: ShardUnits = "auto", reshard_after_forward: bool = True, cpu_offload: bool = False,
                 shard_group_size: int | None = None, async_save: bool = False, mesh: "str | MeshSpec | None" = None,
                 tp_plan: TPPlan = "auto", sequence_parallel: bool = False, loss_parallel: bool = False,
                 pp_split: "str | list[str] | None" = None, pp_schedule: str = "1f1b", pp_microbatches: int | None = None,
                 bitwise: bool = False, micro_batch_size: int | None = None):
        from towers import cluster
        from towers.devices import warn_if_gpus_idle

        info = info or cluster.from_env()
        if shard_units != "auto":
            select_units(nn.Module(), shard_units)  # validates the value now, not at prepare
        self._shard_units = shard_units
        self._reshard_after_forward = parse_flag("reshard_after_forward", reshard_after_forward)
        self._cpu_offload = parse_flag("cpu_offload", cpu_offload)
        self._async_save = parse_flag("async_save", async_save)
        self._owns_group = False
        self._tp_plan = tp_plan
        sequence_parallel = parse_flag("sequence_parallel", sequence_parallel)
        loss_parallel = parse_flag("loss_parallel", loss_parallel)
        self._tp_mesh: Any = None  # the tensor-parallel dimension of a (dp, tp) mesh
        #: The pipeline this process's stage belongs to (with a pp mesh; None without one).
        self.pipeline: StrategyPipeline | None = None
        spec = parse_mesh(mesh)
        if spec is not None:
            spec = spec.resolved(info.world_size)
        pp_spec = spec if spec is not None and spec.pp > 1 else None
        split, schedule = parse_split(pp_split), check_schedule(pp_schedule)
        stages = schedule_spec(schedule).num_stages(spec.pp) if spec is not None else 1
        microbatches = check_microbatches(pp_microbatches, stages)  # default: one per stage
        # Not an error without tp: a script that asks for them runs unchanged on a mesh without tp (nothing to split).
        self._sequence_parallel = tp_option("sequence_parallel", sequence_parallel, spec)
        self._loss_parallel = tp_option("loss_parallel", loss_parallel, spec)
        self._sharded_logits = False  # inside forward_backward under loss_parallel: the head's logits stay split
        device = _replica_device(info)
        warn_if_gpus_idle(info.local_world_size, [device], local_rank=info.local_rank)
        # Options are checked before the process group is joined: a typo fails at once, on every rank alike.
        precision = resolve_precision(precision, device)
        if pp_spec is not None:  # HSDP given in the mesh (dp_replicate=R,dp_shard=S) counts as shard_group_size
            hsdp = pp_spec.dp_shard if pp_spec.dp_shard not in (None, pp_spec.dp) else shard_group_size
            check_pipeline_options(pp_spec, hsdp, precision.name)
        StepTracker(gradient_accumulation_steps)
        if (shard_group_size is None and (spec is None or (spec.pp * spec.tp == 1 and spec.dp_shard is None))
                and info.world_size > info.local_world_size):
            shard_group_size = info.local_world_size  # several nodes: HSDP, shards within a node
        #: The job's degrees of parallelism (pp, dp_replicate x dp_shard, tp), checked before the group is joined.
        self.layout = Layout.from_spec(spec, info.world_size, shard_group_size=shard_group_size)
        build = bitwise_steps(bitwise, micro_batch_size, strategy=type(self).__name__, precision=precision.name,
                              refused=bitwise_refusal(self.layout, self._cpu_offload))
        comm: LocalComm | ProcessGroupComm = LocalComm()
        self._layout_mesh: LayoutMesh | None = None
        if info.world_size > 1:
            from towers.process_group import is_initialized

            self._owns_group = not is_initialized()
            backend = init_process_group(info, backend=backend, timeout_s=timeout_s)
            self._layout_mesh = mesh_ = self.layout.build(device.type)
            comm = replica_comm(mesh_, info.rank, info.world_size, backend=backend, timeout_s=timeout_s)
            if pp_spec is not None:
                self.pipeline = StrategyPipeline(
                    self, spec=pp_spec, comm=pipeline_comm(mesh_, info.rank, schedule), pp_mesh=mesh_.pp,
                    tp_mesh=mesh_.tp, split=split, schedule=schedule, microbatches=microbatches, tp_plan=tp_plan,
                    sequence_parallel=self._sequence_parallel, dp_reduce=lambda op, v: SyncStrategy.reduce(self, op, v))
        if info.world_size == 1 and (self._cpu_offload or precision.name != "32"):  # FSDP2's offload and bf16, one GPU
            self._owns_group = init_one_process_group(device, backend=backend, timeout_s=timeout_s)
            self._layout_mesh = self.layout.build(device.type)
        self._mesh: Any = None if self._layout_mesh is None else self._layout_mesh.fsdp  # what FSDP2 shards over
        self._device_mesh: Any = None  # the whole mesh, under tp or pp (one process's replica spans several)
        if self._layout_mesh is not None and self.layout.model_parallel:
            self._device_mesh, self._tp_mesh = self._layout_mesh.world, self._layout_mesh.tp
        if device.type == "cuda":
            torch.cuda.set_device(device)
        super().__init__(info=info, device=device, comm=comm, precision=precision,
                         gradient_accumulation_steps=gradient_accumulation_steps, layout=self.layout,
                         bitwise=None if build is None else build(comm.rank, comm.num_replicas, self.gather,
                                                                  lockstep=self._mesh is not None))  # FSDP2 gathers
        self._tree = ShardedTree(self._bitwise, self.layout.describe()) if self._bitwise and self._mesh else None
        self._sharded: list[Any] = []  # the FSDP roots prepare() made
        self._state = ShardedState(precision=self.precision, pipeline=self.pipeline, sharded=self._mesh is not None,
                                   async_save=self._async_save)
        log.info("%s: %d replica(s), this one on %s (mesh %s, precision=%s, accumulation=%d, reshard_after_forward=%s, "
                 "cpu_offload=%s)", type(self).__name__, self.num_replicas_in_sync, device,
                 None if self._layout_mesh is None else self._layout_mesh.describe(),
                 self.precision.name, gradient_accumulation_steps, self._reshard_after_forward, self._cpu_offload)

    @property
    def mesh(self) -> Any:
        """The job's one ``DeviceMesh`` (None with one process), built from ``layout``: its dimensions of
        ``("pp", "dp_replicate", "dp_shard", "tp")`` above 1, and ``dp_shard`` always (``towers.parallel.layout``)."""
        return None if self._layout_mesh is None else self._layout_mesh.world

    @property
    def tensor_parallel_size(self) -> int:
        """Processes that split each layer of one model replica (1: no tensor parallelism)."""
        return 1 if self._tp_mesh is None else int(self._tp_mesh.size())

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline stages one model replica is cut into (1: no pipeline parallelism)."""
        return self.layout.pp

    @property
    def pipeline_bubble_fraction(self) -> float | None:
        """The idle fraction of a step of the last prepared pipeline's schedule (``StrategyPipeline.bubble_fraction``);
        None without a pipeline."""
        return None if self.pipeline is None else self.pipeline.bubble_fraction

    # --- preparation ----------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                **options: Any) -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)``: the model sharded over the replicas and an optimizer over its shards.

        The optimizer may be built before ``prepare`` (on the full parameters, as with every other
        strategy): it is pointed at the sharded parameters that replace them. ``options`` are
        ``SyncStrategy.prepare``'s.

        Raises:
            TypeError, ValueError: as ``SyncStrategy.prepare``; ValueError also when the optimizer already has state.
        """
        if isinstance(optimizer, torch.optim.Optimizer) and raw_optimizer(optimizer).state:
            raise InvalidArgumentError(
                "FullyShardedStrategy.prepare needs an optimizer that has not stepped yet (its state would be the "
                "full, unsharded one). Build the optimizer, call prepare, then train; restore state through "
                "strategy.load_checkpoint / load_state_dict.")
        names = {id(p): n for n, p in model.named_parameters()} if isinstance(model, nn.Module) else {}
        wrapped, prepared = super().prepare(model, optimizer, **options)
        if self.pipeline is not None:
            self._user_modules[-1] = self.pipeline.pipelines[-1].module  # the stage (the other stages' are not held here)
        if optimizer is not None and self.pipeline is not None:  # this stage's parameters only, by original name
            self.pipeline.point_optimizer_at_stage(wrapped, optimizer, names)
        elif optimizer is not None and self._mesh is not None:
            sharded = dict(self._user_modules[-1].named_parameters())  # fully_shard swapped them in place
            for group in raw_optimizer(optimizer).param_groups:
                group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
        return wrapped, prepared

    def _parallelize(self, model: nn.Module, activation_checkpointing: str) -> nn.Module:
        if self._mesh is None:  # one process: nothing to shard
            return super()._parallelize(model, activation_checkpointing)
        check_same_parameters(model, self._comm.all_gather_object)
        broadcast_from_first(model)  # as DDP does, before tensor parallelism splits what each process holds
        plan, sequence_parallel = self._tp_plan, self._sequence_parallel
        if self.pipeline is not None:  # this process's stage; the rest lays it out
            # Checkpointing first, on the whole model: its repeated blocks are found there, whatever a stage holds.
            model = parallelize(model, None, ParallelOptions(activation_checkpointing=activation_checkpointing))
            activation_checkpointing = "off"
            model, plan, sequence_parallel = self.pipeline.keep_stage(model)
        options = ParallelOptions(
            tp_plan=plan, sequence_parallel=sequence_parallel, loss_parallel=self._loss_parallel,
            activation_checkpointing=activation_checkpointing,
            shard=ShardOptions(units=self._shard_units, reshard_after_forward=self._reshard_after_forward,
                               precision=self.precision.name, cpu_offload=self._cpu_offload))
        parallelize(model, self._layout_mesh, options, sharded_logits=lambda: self._sharded_logits)
        self._sharded.append(model)
        # No process holds the whole model: copy.deepcopy and pickle (AveragedModel, torch.save) say what works instead.
        refuse_copies(model, self._where_the_model_is())
        return model

    def _where_the_model_is(self) -> str:
        """Why no process holds the prepared model whole, for ``refuse_copies``' error."""
        mesh = ",".join(f"{name}={size}" for name, size in zip(self.mesh.mesh_dim_names, self.mesh.shape))
        if self.pipeline is not None:
            return (f"FullyShardedStrategy split it into {self.layout.pp} pipeline stages (mesh {mesh}) and this process "
                    f"holds stage {self.pipeline.stage}")
        return (f"FullyShardedStrategy sharded it with FSDP2 (mesh {mesh}): its parameters are DTensors, of which this "
                "process holds its shards")

    def _watch_bitwise(self, bitwise: BitwiseSteps, model: nn.Module) -> None:
        super()._watch_bitwise(bitwise, model) if self._tree is None else self._tree.install(model)

    def _set_gradient_sync(self, enabled: bool) -> None:  # off: non-final micro-batches keep unsharded gradients
        for model in self._sharded:
            model.set_requires_gradient_sync(enabled)

    def _before_step_check(self, wrapped: nn.Module) -> Callable[[], None] | None:
        # FSDP2's reduce-scatter is its own (no hook to fold the step's identity into): one small all-reduce of its own.
        if self._mesh is None:
            return None
        check = StepCheck(self._tracker, rank=self.replica_id, num_replicas=self.num_replicas_in_sync)
        # torch's own clip: it measured one stage, or shards in another order than one device (bitwise)
        before = self.pipeline.stage_grads.check if self.pipeline else self._tree.before_step(wrapped) if self._tree else None
        return compare_before_step(check, self.device, getattr(self._comm, "group", None), before=before)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module: FSDP2 shards it in place (its parameters become DTensors), so nothing wraps it."""
        for user, wrapped in zip(self._user_modules, self._wrapped):
            if model is wrapped:
                return user
        return model

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """``Strategy.forward_backward`` (a pipeline's schedule under pp); under ``loss_parallel`` the loss and its
        backward run inside torch's ``loss_parallel()`` on logits split over the vocabulary, and the loss comes back
        whole (``outputs``: the split logits, a DTensor)."""
        if self.pipeline is not None and not self._loss_parallel:
            return self.pipeline.forward_backward(model, inputs, targets, loss_fn)
        if not self._loss_parallel:
            return super().forward_backward(model, inputs, targets, loss_fn)
        self._sharded_logits = True
        try:
            with loss_parallel_scope(True):
                loss, outputs = (super().forward_backward(model, inputs, targets, loss_fn) if self.pipeline is None
                                 else self.pipeline.forward_backward(model, inputs, targets, loss_fn))
        finally:
            self._sharded_logits = False
        return whole(loss), outputs

    # --- gradients ------------------------------------------------------------------------------------
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``parameters`` (sharded or not) to a global norm ``max_norm``; return the norm before clipping.

        The norm is over the whole model (every rank's shards), so every rank clips by the same factor.
        """
        if self._tree is not None and self._updates_now():
            self._finish_loss_weights("clip")  # one device's norm, from the gradients gathered whole
            return self._tree.clip(parameters, max_norm, norm_type)
        if self.pipeline is None:
            total = super().clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
            return whole(total)
        return self.pipeline.clip_grad_norm_(parameters, max_norm, norm_type)

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` across replicas (``SyncStrategy.reduce``); with a pipeline, every stage gets the LAST stage's
        result (where the losses and the model's outputs are), so logs and decisions agree on every process."""
        result = super().reduce(op, value, axis)
        return result if self.pipeline is None else self.pipeline.comm.from_last_stage(result)

    # --- the loss normalisers' hooks: under pp the update ends with its last schedule, not a backward of its own ---
    def note_weighted_loss(self, loss: torch.Tensor, weight: float, *, update_step: bool) -> None:
        """``Strategy.note_weighted_loss``; with a pipeline the gradients are divided after the update's last schedule."""
        if self.pipeline is None:
            return super().note_weighted_loss(loss, weight, update_step=update_step)
        return self.pipeline.note_weighted_loss(weight)

    def note_example_normalised_loss(self, *, update_step: bool) -> None:
        """``Strategy.note_example_normalised_loss``; with a pipeline the update closes after its last schedule, so a
        weighted loss in another micro-batch of it is still refused."""
        self._loss_weights.note_plain(update_step and self.pipeline is None)

    def _compile(self, module: nn.Module, compile: bool | Mapping[str, Any]) -> nn.Module:
        if self.pipeline is not None and compile_options(compile) is not None:
            raise self.pipeline.compile_refused(f"prepare(..., compile={compile!r})")
        return super()._compile(module, compile)

    # --- state and checkpoints: over FSDP2's shards (``towers.strategies._sharded_state``) ----------------
    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        """``ShardedState.state_dict``: this rank's shards (DTensors); a collective. One process: a plain module's."""
        return super().state_dict(model, optimizer) if self._mesh is None else self._state.state_dict(model, optimizer)

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
        """``ShardedState.load_state_dict``: shards, or a full state from any strategy, cut into this rank's shards."""
        (super().load_state_dict if self._mesh is None else self._state.load_state_dict)(state, model, optimizer)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """``ShardedState.full_state_dict``: the whole model's state gathered onto the CPU (a collective)."""
        return super().full_state_dict(model) if self._mesh is None else self._state.full_state_dict(model)

    def checkpoint_io(self) -> CheckpointIO:
        """``ShardedState.checkpoint_io``: every process writes its own shards (``async_save``: in a background thread)."""
        return self._state.checkpoint_io()

    def shutdown(self) -> None:
        """Finish an asynchronous checkpoint in flight, then leave the process group this strategy joined (idempotent)."""
        self.wait_for_checkpoint()
        if self._owns_group:
            destroy_process_group()
            self._owns_group = False

