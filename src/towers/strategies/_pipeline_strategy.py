"""What a strategy with a ``pp`` mesh does differently: the step, the values every stage sees, the norm, checkpoints.

A base class of ``FullyShardedStrategy`` (its state is the strategy's): without a pipeline
(``_pp_comm`` None) every method here is the next class's. See ``towers.strategies._pipeline``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from towers.cluster.mesh import MeshSpec
from towers.errors import user_error
from towers.strategies._collectives import ProcessGroupComm
from towers.strategies._loss_weights import note_normalised
from towers.strategies._pipeline import Pipeline, PipelineComm, build_pipeline_mesh
from towers.strategies._sync import SyncStrategy
from towers.strategies.base import ReplicaContext, current_replica_context
from towers.strategies.context import check_max_norm

__all__ = ["PipelineSteps"]


class PipelineSteps(SyncStrategy):
    """The pipeline-parallel half of a synchronous strategy on a ``(pp, dp, tp)`` mesh."""

    _pp_spec: MeshSpec | None
    _pp_comm: PipelineComm | None
    _pipelines: list[Pipeline]
    _device_mesh: Any
    _mesh: Any
    _pp_mesh: Any

    def _build_pp_mesh(self, spec: MeshSpec, device: torch.device, backend: str, timeout_s: float) -> ProcessGroupComm:
        """The ``(pp, dp, tp)`` mesh; return the collectives over this process's data-parallel group (its replicas)."""
        self._device_mesh, groups, last_rank = build_pipeline_mesh(spec, device.type)
        self._mesh, self._pp_mesh = self._device_mesh["dp"], self._device_mesh["pp"]
        self._pp_comm = PipelineComm(self._pp_mesh.get_group(), last_rank=last_rank, stages=spec.pp)
        return ProcessGroupComm(rank=self._device_mesh.get_local_rank("dp"), num_replicas=spec.dp, backend=backend,
                                timeout_s=timeout_s, group=self._mesh.get_group(), groups=groups)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Return ``(loss, outputs)`` after one forward and backward; with a pipeline, its schedule over the micro-batches.

        With a ``pp`` mesh every stage of the pipeline calls it with the same ``inputs`` and ``targets``:
        the last stage calls ``loss_fn`` once per micro-batch (``compute_average_loss`` there divides by
        the step's GLOBAL batch size), ``loss`` (their sum) reaches every stage, ``outputs`` only the last
        stage (None on the others). Without one, ``Strategy.forward_backward``.
        """
        if self._pp_comm is None:
            return super().forward_backward(model, inputs, targets, loss_fn)
        stage = self.unwrap(model)
        pipeline = next((p for p in self._pipelines if p.module is stage), None)
        if pipeline is None:
            raise user_error("strategy.forward_backward takes the model strategy.prepare returned",
                             f"a {type(model).__name__} this strategy did not prepare",
                             "Call model, optimizer = strategy.prepare(model, optimizer) first and pass that model.")
        context = current_replica_context()
        if context is None or context is self._implicit_context:  # a loop without strategy.run: its batch starts the step
            self._step_outside_run(model, (inputs, targets), {})
            context = current_replica_context() or ReplicaContext(self)
        loss, outputs = pipeline.step(inputs, targets, loss_fn, context=context, enter=self._entered)
        if not pipeline.is_last:
            note_normalised()  # the last stage normalised the loss whose gradient reached this stage
        return loss, outputs

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` across replicas (``SyncStrategy.reduce``); with a pipeline, every stage gets the LAST stage's
        result (where the losses and the model's outputs are), so logs and decisions agree on every process."""
        result = super().reduce(op, value, axis)
        return result if self._pp_comm is None else self._pp_comm.from_last_stage(result)

    def _check_weighted_loss(self) -> None:
        if self._pp_spec is not None:
            raise user_error("compute_average_loss(..., weights=...) (and a loss that returns its batch's mean) is not "
                             "built under pipeline parallelism", f"mesh {self._pp_spec.describe()}",
                             "Return one loss per example (reduction='none') and normalise it with "
                             "towers.compute_average_loss(per_example_loss).")
        super()._check_weighted_loss()

    def _clip_over_stages(self, comm: PipelineComm, parameters: Any, max_norm: float, norm_type: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` with the norm over every stage's gradients (torch's own sees one stage)."""
        check_max_norm(max_norm)
        self._finish_loss_weights("clip")
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=self.device)
        total = comm.grad_norm(local.full_tensor() if hasattr(local, "full_tensor") else local, norm_type)
        coefficient = min(1.0, float(max_norm) / (float(total) + 1e-6))
        for grad in grads:
            grad.mul_(coefficient)
        return total

    def _refuse_pipeline_checkpoint(self) -> None:
        if self._pp_spec is not None:
            raise user_error("Checkpoints (towers.checkpoint, strategy.state_dict) of a pipelined model are not built yet",
                             f"mesh {self._pp_spec.describe()}",
                             "Save the whole model's weights from strategy.full_state_dict(model) (every process gets "
                             "them) on the chief with torch.save, or train without pp to checkpoint.",
                             cls=NotImplementedError)

