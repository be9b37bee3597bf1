"""MirroredStrategy (one process per local device) and MultiWorkerMirroredStrategy (the same across hosts).

Each process is one replica with a full copy of the model. ``prepare`` wraps the model in DDP
(bucketed all-reduce overlapped with the backward pass) with a communication hook that SUMS
gradients: every replica's loss is already divided by the global batch size
(``compute_average_loss``), so the sum is exactly one device's gradient of the global batch.
With a single process no process group is created and the strategy behaves like one device.

``mesh="dp=D,tp=T"`` adds tensor parallelism inside each replica: the T processes of one replica split
its layers (``towers.parallel.tensor_parallel``) and see the same batch, and DDP sums each slice's
gradient over the D processes that hold that slice (``_tp_slices.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from towers._logging import get_logger
from towers.checkpoint.state import is_by_name, optimizer_by_name
from towers.cluster.info import ProcessInfo
from towers.cluster.mesh import MeshSpec, parse_mesh
from towers.cluster.strategy_options import parse_flag
from towers.errors import FailedPreconditionError, InvalidArgumentError, user_error
from towers.parallel.compile import compile_options
from towers.parallel.fsdp import broadcast_from_first
from towers.parallel.layout import Layout, LayoutMesh
from towers.parallel.parallelize import ParallelOptions, parallelize
from towers.parallel.stage_gradients import StageGradientGuard
from towers.parallel.tensor_parallel import TPPlan
from towers.process_group import DEFAULT_TIMEOUT_S, destroy_process_group, init_process_group
from towers.strategies._bitwise_setup import bitwise_steps
from towers.strategies._collectives import LocalComm, ProcessGroupComm, replica_comm
from towers.strategies._comm_hooks import check_compression, register_sum_hook
from towers.strategies._copies import refuse_copies
from towers.strategies._ddp import TowersDDP, check_same_parameters, unused_parameters_error
from towers.strategies._step_check import StepCheck
from towers.strategies._steps import StepTracker
from towers.strategies._sync import SyncStrategy
from towers.strategies._sync_bn import convert_sync_batchnorm
from towers.strategies._tp_slices import (
    TensorParallelSlices,
    check_tensor_parallel_options,
    grad_norm,
    slice_gradient_guard,
)
from towers.strategies.context import check_max_norm
from towers.strategies.precision import Precision, resolve_precision

__all__ = ["MirroredStrategy", "MultiWorkerMirroredStrategy"]

log = get_logger(__name__)


def _replica_device(info: ProcessInfo) -> torch.device:
    # GPUs only when every local replica gets its own (the rule choose_backend uses for NCCL too);
    # otherwise every replica computes on the CPU, and the idle-GPU check says so.
    from towers.devices import gpu_count

    return torch.device("cuda", info.local_rank) if gpu_count() >= info.local_world_size else torch.device("cpu")


class MirroredStrategy(SyncStrategy):
    """Synchronous data parallelism: one replica per process, gradients summed by DDP's all-reduce.

    ``mesh`` (``"dp=2,tp=2"``, or ``towers launch --mesh``) adds tensor parallelism: the ``tp`` processes
    of one model replica split its layers by ``tp_plan`` and see the same batch; DDP sums each slice's
    gradient over ``dp``. ``num_replicas_in_sync`` is then ``dp``. The prepared model's parameters are this
    process's slices: clip with ``strategy.clip_grad_norm_`` (the whole model's norm; torch's own would
    measure the slices: the step after it is refused), save with ``strategy.state_dict`` /
    ``save_checkpoint`` (whole tensors, gathered). Not with a tp mesh: ``pp`` (use ``--strategy sharded``),
    ``gradient_compression="powersgd"``, ``sync_batchnorm``, ``precision="fp16"`` and ``compile``; each is
    refused with its reason.

    Args:
        info: this process's place in the job. Default: read from the environment (``towers launch``,
            torchrun, SLURM, TF_CONFIG).
        timeout_s: the deadline of every collective, in seconds.
        backend: the process group's backend: ``"auto"`` (NCCL on GPUs, Gloo on CPUs), ``"nccl"`` or ``"gloo"``.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (mixed precision with autocast; fp16 with a loss scaler).
        gradient_accumulation_steps: micro-batches per optimizer update; no all-reduce on all but the last.
        gradient_compression: ``"fp16"``, ``"bf16"`` or ``"powersgd"``: the gradients sent compressed.
        sync_batchnorm: BatchNorm statistics over the global batch (CPU included).
        bucket_cap_mb: DDP's bucket size in megabytes; None keeps DDP's own layout, whose small first bucket
            lets the first all-reduce overlap the rest of backward.
        find_unused_parameters: DDP's, for models that leave parameters unused in a step.
        powersgd_rank: the rank of PowerSGD's low-rank approximation (``gradient_compression="powersgd"``).
        powersgd_start_iter: the updates sent uncompressed before PowerSGD starts.
        mesh: a device mesh such as ``"dp=2,tp=2"`` (tensor parallelism within each replica). Default: every
            process a replica.
        tp_plan: how a tp mesh splits the model: ``"auto"`` (towers' GPT, Hugging Face models with a
            ``base_model_tp_plan``, ``nn.Sequential`` MLPs), or a dict / callable (see
            ``towers.parallel.tensor_parallel``).
        bitwise: the same bits at any replica count: gradients summed per micro-batch in a fixed tree
            (``docs/bitwise.md``); ``micro_batch_size`` given, or a twelfth of the global batch.
        micro_batch_size: the examples of one micro-batch under ``bitwise=True``.

    Raises:
        ValueError: an option out of range or refused with another (the message names the fix), before the
            process group is joined.

    Example:
        <!-- not-run: a job of several processes: towers launch --nproc-per-node 2 --strategy mirrored train.py -->
        ```python
        import torch
        import towers

        strategy = towers.MirroredStrategy(precision="bf16")  # or towers.strategy_from_env()
        with strategy.scope():
            model = torch.nn.Linear(16, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = strategy.prepare(model, optimizer)
        ```
    """

    name = "mirrored"

    def __init__(self, *, info: ProcessInfo | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str = "auto", precision: "str | int | Precision | None" = "32", gradient_accumulation_steps: int = 1,
                 gradient_compression: str | None = None, sync_batchnorm: bool = False,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 powersgd_rank: int = 1, powersgd_start_iter: int = 10, mesh: "str | MeshSpec | None" = None,
                 tp_plan: TPPlan = "auto", bitwise: bool = False, micro_batch_size: int | None = None):
        from towers import cluster
        from towers.devices import warn_if_gpus_idle

        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or not bucket_cap_mb > 0):
            raise InvalidArgumentError(f"bucket_cap_mb must be a number of megabytes > 0 (or None for DDP's default). "
                                       f"Received: {bucket_cap_mb!r}. Pass e.g. bucket_cap_mb=25 (--strategy-option "
                                       "bucket_cap_mb=25), or leave it out.")
        self._compression = check_compression(gradient_compression)
        self._sync_batchnorm = parse_flag("sync_batchnorm", sync_batchnorm)
        # Passed to DDP only when set: an explicit value also drops DDP's small first bucket.
        self._ddp_options = {} if bucket_cap_mb is None else {"bucket_cap_mb": float(bucket_cap_mb)}
        self._find_unused = parse_flag("find_unused_parameters", find_unused_parameters)
        self._powersgd = {"powersgd_rank": int(powersgd_rank), "powersgd_start_iter": int(powersgd_start_iter)}
        self._owns_group = False
        self._ddp_models: list[TowersDDP] = []
        self._tp_plan = tp_plan
        self._slices: dict[int, TensorParallelSlices] = {}  # id(user module) -> its tensor-parallel slices
        self._guards: dict[int, StageGradientGuard] = {}  # id(DDP) -> torch's own clip on its slices, refused
        info = info or cluster.from_env()
        device = _replica_device(info)
        warn_if_gpus_idle(info.local_world_size, [device], local_rank=info.local_rank)
        # Options are checked before the process group is joined: a typo fails at once, on every rank alike.
        precision = resolve_precision(precision, device)
        StepTracker(gradient_accumulation_steps)
        spec = parse_mesh(mesh)
        spec = None if spec is None else spec.resolved(info.world_size)
        if spec is not None and (spec.dp_shard or 1) > 1:
            raise user_error("MirroredStrategy does not shard: DDP keeps each replica's parameters whole",
                             f"mesh {spec.given()}", f"Use mesh dp={spec.dp}{f',tp={spec.tp}' if spec.tp > 1 else ''} "
                             "for replicas, or --strategy sharded for dp_shard (FSDP2, HSDP).")
        if spec is not None and spec.pp * spec.tp > 1:
            check_tensor_parallel_options(spec, precision, self._compression, self._sync_batchnorm)
        build = bitwise_steps(bitwise, micro_batch_size, strategy=type(self).__name__, precision=precision.name,
                              refused=None if spec is None or spec.tp == 1 else f"mesh {spec.given()}: tp's all-reduces")
        if build is not None and (gradient_compression not in (None, "none") or self._sync_batchnorm):
            raise user_error(f"{type(self).__name__}(bitwise=True) sums gradients over its own tree",
                             f"gradient_compression={gradient_compression!r}, sync_batchnorm={self._sync_batchnorm}",
                             "Leave gradient_compression and sync_batchnorm out with bitwise=True.")
        #: The job's degrees: ``dp`` replicas of ``tp`` processes each (without a tp mesh, every process a replica).
        self.layout = Layout(dp_replicate=info.world_size) if spec is None or spec.tp == 1 else \
            Layout(dp_replicate=spec.dp, tp=spec.tp)
        #: The (dp_replicate, dp_shard, tp) mesh under a tp mesh; None otherwise (no mesh built: the job's one group).
        self._layout_mesh: LayoutMesh | None = None
        comm: LocalComm | ProcessGroupComm = LocalComm()
        if info.world_size > 1:
            from towers.process_group import is_initialized

            self._owns_group = not is_initialized()
            backend = init_process_group(info, backend=backend, timeout_s=timeout_s)
            if self.layout.tp == 1:
                comm = ProcessGroupComm(rank=info.rank, num_replicas=info.world_size, backend=backend,
                                        timeout_s=timeout_s)
            else:  # the replicas' group: each process with the others holding the same slices
                self._layout_mesh = self.layout.build(device.type)
                comm = replica_comm(self._layout_mesh, info.rank, info.world_size, backend=backend, timeout_s=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        super().__init__(info=info, device=device, comm=comm, precision=precision,
                         gradient_accumulation_steps=gradient_accumulation_steps,
                         bitwise=None if build is None else build(comm.rank, comm.num_replicas, self.gather,
                                                                        getattr(comm, "group", None)),
                         layout=self.layout)
        log.info("%s: %d replica(s), this one on %s (%sprecision=%s, accumulation=%d, compression=%s%s)",
                 type(self).__name__, self.num_replicas_in_sync, device,
                 "" if self._layout_mesh is None else f"mesh {self._layout_mesh.describe()}, ", self.precision.name,
                 gradient_accumulation_steps, self._compression, ", sync_batchnorm" if self._sync_batchnorm else "")

    @property
    def mesh(self) -> Any:
        """The job's ``DeviceMesh`` under a tp mesh (``(dp_replicate, dp_shard, tp)``, ``towers.parallel.layout``);
        None without one (every process a replica of the whole model, on the job's one group)."""
        return None if self._layout_mesh is None else self._layout_mesh.world

    @property
    def tensor_parallel_size(self) -> int:
        """Processes that split each layer of one model replica (1: no tensor parallelism)."""
        return self.layout.tp

    # --- preparation under a tp mesh ------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                **options: Any) -> tuple[nn.Module, Any]:
        """``SyncStrategy.prepare``; under a tp mesh an optimizer built before it (on the whole parameters) is pointed
        at the slices that replace them, by name.

        Raises:
            TypeError, ValueError: as ``SyncStrategy.prepare``; ValueError also, under a tp mesh, for an optimizer
                that already has state (it would be the whole tensors').
        """
        if self._layout_mesh is None or not isinstance(model, nn.Module):
            return super().prepare(model, optimizer, **options)
        raw = getattr(optimizer, "optimizer", optimizer)
        if isinstance(raw, torch.optim.Optimizer) and raw.state:
            raise user_error("MirroredStrategy with a tp mesh needs an optimizer that has not stepped yet",
                             f"{type(raw).__name__} with state for {len(raw.state)} parameter(s)",
                             "Build the optimizer, call prepare, then train; restore state through "
                             "strategy.load_state_dict or restore_checkpoint.")
        names = {id(p): n for n, p in model.named_parameters()}
        wrapped, prepared = super().prepare(model, optimizer, **options)
        if isinstance(raw, torch.optim.Optimizer):
            slices = dict(model.named_parameters())  # tensor parallelism swapped them in place
            for group in raw.param_groups:
                group["params"] = [slices.get(names.get(id(p), ""), p) for p in group["params"]]
        return wrapped, prepared

    def _parallelize(self, model: nn.Module, activation_checkpointing: str) -> nn.Module:
        if self._layout_mesh is None:
            return super()._parallelize(model, activation_checkpointing)
        check_same_parameters(model, self._comm.all_gather_object)
        broadcast_from_first(model)  # as DDP does over dp, before tensor parallelism splits what each process holds
        options = ParallelOptions(tp_plan=self._tp_plan, activation_checkpointing=activation_checkpointing)
        return parallelize(model, self._layout_mesh, options, wrap=self._wrap_model)

    def _compile(self, module: nn.Module, compile: bool | Mapping[str, Any]) -> nn.Module:
        if self._layout_mesh is not None and compile_options(compile) is not None:
            raise user_error("prepare(compile=...) is not available with MirroredStrategy's tp mesh (the layers read "
                             "DTensor views of their slices, made again before each forward)",
                             f"compile={compile!r}, mesh {self._layout_mesh.describe()}",
                             "Leave compile out, or drop tp from the mesh.")
        return super()._compile(module, compile)

    def _where_the_model_is(self) -> str:
        return (f"MirroredStrategy split its layers over the tp processes of each replica (mesh "
                f"{self._layout_mesh.describe() if self._layout_mesh is not None else ''}): its split parameters are "
                "this process's slices")

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if self._bitwise is not None:  # no DDP: the tree sums the gradients; every replica starts from the chief's
            if self.num_replicas_in_sync > 1:
                check_same_parameters(model, self._comm.all_gather_object)
                broadcast_from_first(model)
            return super()._wrap_model(model)
        if self._layout_mesh is not None:  # DDP sums each slice over the replicas: the slices become the parameters
            self._slices[id(model)] = TensorParallelSlices(model)
            refuse_copies(model, self._where_the_model_is())
        if self.num_replicas_in_sync == 1:  # nothing to synchronise; BatchNorm over one replica is already "synced"
            return super()._wrap_model(model)
        if self._sync_batchnorm:
            model = convert_sync_batchnorm(model, self.device)
        check_same_parameters(model, self._comm.all_gather_object)
        group = self._comm.group if isinstance(self._comm, ProcessGroupComm) else None  # None: the job's one group
        ddp = TowersDDP(model, precision=self._precision,
                        device_ids=[self.device.index] if self.device.type == "cuda" else None,
                        find_unused_parameters=self._find_unused, **self._ddp_options,
                        **({} if group is None else {"process_group": group}))
        # Every synchronised step's first bucket carries the step's identity: replicas out of step stop there.
        check = StepCheck(self._tracker, rank=self.replica_id, num_replicas=self.num_replicas_in_sync)
        register_sum_hook(ddp, self._compression, self.num_replicas_in_sync, check=check, group=group, **self._powersgd)
        if self._layout_mesh is not None:
            refuse_copies(ddp, self._where_the_model_is())
            self._guards[id(ddp)] = slice_gradient_guard(model, self.layout.describe())
        self._ddp_models.append(ddp)
        return ddp

    def _set_gradient_sync(self, enabled: bool) -> None:
        # What DDP's no_sync() sets: read in forward(), so the backward skips (or does) the all-reduce. Only what
        # towers paused is resumed: a user's own `with model.no_sync():` (or nanoGPT's
        # `model.require_backward_grad_sync = False`) stays in force for that forward.
        for ddp in self._ddp_models:
            if not enabled:
                ddp.towers_paused_sync = ddp.towers_paused_sync or ddp.require_backward_grad_sync
                ddp.require_backward_grad_sync = False
            elif ddp.towers_paused_sync:
                ddp.towers_paused_sync = False
                ddp.require_backward_grad_sync = True

    def _finish_loss_weights(self, when: str = "step") -> None:
        for ddp in self._ddp_models:  # a manual accumulation's gradients whole before a step or a clip reads them
            ddp.settle_gradients()
        super()._finish_loss_weights(when)

    def _before_step_check(self, wrapped: nn.Module) -> Callable[[], None] | None:
        if not isinstance(wrapped, TowersDDP):
            return None
        seen = {"calls": wrapped.towers_forward_calls, "first": True}
        find_unused = self._find_unused
        guard = self._guards.get(id(wrapped))  # under a tp mesh: torch's own clip on the slices

        def check() -> None:
            if guard is not None:
                guard.check()
            if wrapped.towers_forward_calls == seen["calls"]:
                raise FailedPreconditionError(
                    "optimizer.step() ran, but the model returned by strategy.prepare was not called since the last "
                    "update, so no gradient was all-reduced and the replicas would drift apart. Expected the step to "
                    "call the prepared model: `model, optimizer = strategy.prepare(model, optimizer)` and then "
                    "`model(x)` — not the original module.")
            seen["calls"] = wrapped.towers_forward_calls
            if seen["first"]:
                seen["first"] = False
                missing = [n for n, p in wrapped.module.named_parameters() if p.requires_grad and p.grad is None]
                if missing and not find_unused:
                    raise unused_parameters_error(missing)

        return check

    # --- whole-model gradients and state under a tp mesh (``_tp_slices.py``) --------------------------------
    def _slices_of(self, model: nn.Module) -> TensorParallelSlices | None:
        return self._slices.get(id(self.unwrap(model)))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``Strategy.clip_grad_norm_``; under a tp mesh the norm is the whole model's (the slices' terms summed over
        tp), so every process clips by the same factor, as one device would."""
        if not self._slices:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        check_max_norm(max_norm)
        updates = self._updates_now()  # else: the norm of what this replica accumulated so far, nothing clipped
        if updates:
            self._finish_loss_weights("clip")
        total = grad_norm(params, norm_type, list(self._slices.values()))
        if updates:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            for guard in self._guards.values():  # towers' own change: the whole model's norm
                guard.note(params)
        return total

    def state_dict(self, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        """``Strategy.state_dict``; under a tp mesh with the split tensors gathered whole (a collective: every process
        calls it), so it loads under any strategy and into a plain model."""
        state = super().state_dict(model, optimizer)
        slices = self._slices_of(model)
        if slices is None:
            return state
        return {**state, "model": slices.full_model_state(state["model"]),
                "optimizer": slices.full_optimizer_state(state.get("optimizer"))}

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module, optimizer: Any = None) -> None:
        """``Strategy.load_state_dict``; under a tp mesh whole tensors (from any strategy) are cut to this process's
        slices first."""
        slices = self._slices_of(model)
        if slices is not None:
            saved = state.get("optimizer")
            if optimizer is not None and saved is not None and not is_by_name(saved):
                saved = optimizer_by_name(saved, optimizer, self.unwrap(model))
            state = {**state, "model": slices.cut_model_state(state["model"]),
                     "optimizer": slices.cut_optimizer_state(saved)}
        super().load_state_dict(state, model, optimizer)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The user's module's whole ``state_dict()`` (under a tp mesh gathered over tp: every process calls it)."""
        state = super().full_state_dict(model)
        slices = self._slices_of(model)
        return state if slices is None else slices.full_model_state(state)

    def shutdown(self) -> None:
        """Leave the process group this strategy joined (idempotent)."""
        if self._owns_group:
            destroy_process_group()
            self._owns_group = False

class MultiWorkerMirroredStrategy(MirroredStrategy):
    """MirroredStrategy across hosts: one replica per device on every worker; the chief is ``info.chief_rank``.

    Args:
        info: this process's place in the job. Default: read from the environment.
        timeout_s: the deadline of every collective, in seconds.
        backend: ``"auto"`` (NCCL on GPUs, Gloo on CPUs), ``"nccl"`` or ``"gloo"``.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        gradient_accumulation_steps: micro-batches per optimizer update.
        gradient_compression: ``"fp16"``, ``"bf16"`` or ``"powersgd"``.
        sync_batchnorm: BatchNorm statistics over the global batch.
        bucket_cap_mb: DDP's bucket size in megabytes (None: DDP's own).
        find_unused_parameters: DDP's, for models that leave parameters unused.
        powersgd_rank: the rank of PowerSGD's approximation.
        powersgd_start_iter: the updates sent uncompressed before PowerSGD starts.
        mesh: a device mesh such as ``"dp=4,tp=2"``.
        tp_plan: how a tp mesh splits the model (``"auto"``, a dict or a callable).
        bitwise: the same bits at any replica count (``micro_batch_size``: given, or a twelfth of the global batch).
        micro_batch_size: the examples of one micro-batch under ``bitwise=True``.

    Each works as under ``MirroredStrategy``.
    """

    name = "multi_worker_mirrored"
