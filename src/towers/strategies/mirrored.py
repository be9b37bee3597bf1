"""MirroredStrategy (one process per local device) and MultiWorkerMirroredStrategy (the same across hosts).

Each process is one replica with a full copy of the model. ``prepare`` wraps the model in DDP
(bucketed all-reduce overlapped with the backward pass) with a communication hook that SUMS
gradients: every replica's loss is already divided by the global batch size
(``compute_average_loss``), so the sum is exactly one device's gradient of the global batch.
With a single process no process group is created and the strategy behaves like one device.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.cluster.strategy_options import parse_flag
from towers.errors import FailedPreconditionError, InvalidArgumentError
from towers.process_group import DEFAULT_TIMEOUT_S, destroy_process_group, init_process_group
from towers.strategies._collectives import LocalComm, ProcessGroupComm
from towers.strategies._comm_hooks import check_compression, register_sum_hook
from towers.strategies._ddp import TowersDDP, check_same_parameters, unused_parameters_error
from towers.strategies._step_check import StepCheck
from towers.strategies._steps import StepTracker
from towers.strategies._sync import SyncStrategy
from towers.strategies._sync_bn import convert_sync_batchnorm
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

    Options: ``precision`` (``"32"``, ``"bf16"``, ``"fp16"``), ``gradient_accumulation_steps``
    (micro-batches per update; no all-reduce on the others), ``gradient_compression``
    (``"fp16"``, ``"bf16"``, ``"powersgd"``), ``sync_batchnorm`` (BatchNorm statistics over
    the global batch, CPU included), ``bucket_cap_mb`` (DDP bucket size; None keeps DDP's own
    layout, whose small first bucket lets the first all-reduce overlap the rest of backward),
    ``find_unused_parameters`` (DDP's, for models that leave parameters unused),
    ``backend`` (``"auto"``: NCCL on GPUs, Gloo on CPUs) and ``timeout_s`` for every collective.
    """

    name = "mirrored"

    def __init__(self, *, info: ProcessInfo | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 backend: str = "auto", precision: "str | int | Precision | None" = "32", gradient_accumulation_steps: int = 1,
                 gradient_compression: str | None = None, sync_batchnorm: bool = False,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 powersgd_rank: int = 1, powersgd_start_iter: int = 10):
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
        info = info or cluster.from_env()
        device = _replica_device(info)
        warn_if_gpus_idle(info.local_world_size, [device], local_rank=info.local_rank)
        # Options are checked before the process group is joined: a typo fails at once, on every rank alike.
        precision = resolve_precision(precision, device)
        StepTracker(gradient_accumulation_steps)
        comm: LocalComm | ProcessGroupComm = LocalComm()
        if info.world_size > 1:
            from towers.process_group import is_initialized

            self._owns_group = not is_initialized()
            backend = init_process_group(info, backend=backend, timeout_s=timeout_s)
            comm = ProcessGroupComm(rank=info.rank, num_replicas=info.world_size, backend=backend, timeout_s=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        super().__init__(info=info, device=device, comm=comm, precision=precision,
                         gradient_accumulation_steps=gradient_accumulation_steps)
        log.info("%s: %d replica(s), this one on %s (precision=%s, accumulation=%d, compression=%s%s)",
                 type(self).__name__, self.num_replicas_in_sync, device, self.precision.name,
                 gradient_accumulation_steps, self._compression, ", sync_batchnorm" if self._sync_batchnorm else "")

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if self.num_replicas_in_sync == 1:  # nothing to synchronise; BatchNorm over one replica is already "synced"
            return super()._wrap_model(model)
        if self._sync_batchnorm:
            model = convert_sync_batchnorm(model, self.device)
        check_same_parameters(model, self._comm.all_gather_object)
        ddp = TowersDDP(model, precision=self._precision,
                        device_ids=[self.device.index] if self.device.type == "cuda" else None,
                        find_unused_parameters=self._find_unused, **self._ddp_options)
        # Every synchronised step's first bucket carries the step's identity: replicas out of step stop there.
        check = StepCheck(self._tracker, rank=self.replica_id, num_replicas=self.num_replicas_in_sync)
        register_sum_hook(ddp, self._compression, self.num_replicas_in_sync, check=check, **self._powersgd)
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

        def check() -> None:
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

    def shutdown(self) -> None:
        """Leave the process group this strategy joined (idempotent)."""
        if self._owns_group:
            destroy_process_group()
            self._owns_group = False

class MultiWorkerMirroredStrategy(MirroredStrategy):
    """MirroredStrategy across hosts: one replica per device on every worker; the chief is ``info.chief_rank``."""

    name = "multi_worker_mirrored"
