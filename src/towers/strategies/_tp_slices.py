"""A tensor-parallel model under DDP (``MirroredStrategy(mesh="dp=D,tp=T")``): its split parameters held as slices.

DDP all-reduces plain tensors. So every DTensor parameter that tensor parallelism made is replaced in
its module by this process's slice of it, an ``nn.Parameter`` (what DDP's buckets, the optimizer,
``named_parameters`` and ``state_dict`` see), and the module reads a DTensor view of that slice
(``DTensor.from_local``, sharing its memory) under the parameter's name: the view is the module's
attribute, made again before each forward of the model, so the layers' tensor-parallel hooks compute
on DTensors as before, the gradients land on the slices, and DDP sums them over the dp group. (torch's
own ``_pre_dp_module_transform`` swaps the DTensors in as plain attributes at the first forward and
never back: the module is then left without those parameters, for an optimizer or a checkpoint.)

What reads parameters as a whole goes through ``TensorParallelSlices``: the gradient norm (the split
slices' terms summed over tp, the replicated parameters' counted once) and the state: ``full`` gathers
whole tensors over tp (what a checkpoint holds; any strategy, or a plain model, loads it), ``cut`` takes
this process's slice of a whole tensor.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from towers.errors import user_error
from towers.parallel.stage_gradients import StageGradientGuard
from towers.process_group import collective
from towers.strategies._loss_weights import queue_after_backward

__all__ = ["SliceSpec", "TensorParallelSlices", "grad_norm", "slice_gradient_guard", "check_tensor_parallel_options"]


class SliceSpec(NamedTuple):
    """How a parameter is split: its DTensor's mesh, placements, whole shape and stride, and this process's slice shape."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    local_shape: tuple[int, ...]

    @property
    def split(self) -> bool:
        """Whether the processes hold different slices (a ``Shard`` placement), not each the whole tensor."""
        return any(p.is_shard() for p in self.placements)


def _waited(grad: torch.Tensor) -> torch.Tensor:
    """A gradient still in flight from a functional collective, waited for before DDP copies it into a bucket."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return grad.wait() if isinstance(grad, AsyncCollectiveTensor) else grad


class TensorParallelSlices:
    """The slices of one tensor-parallel module's DTensor parameters, swapped in for them (see the module docstring)."""

    def __init__(self, module: nn.Module):
        from torch.distributed.tensor import DTensor

        #: Parameter name (every name of a shared one, as ``state_dict`` lists them) -> how it is split.
        self.specs: dict[str, SliceSpec] = {}
        self._views: dict[tuple[int, str], tuple[nn.Module, str, nn.Parameter, SliceSpec]] = {}
        #: The ids of the slices of split parameters (whose gradient norms are summed over tp).
        self.split_ids: set[int] = set()
        made: dict[int, tuple[nn.Parameter, SliceSpec]] = {}
        found = [(f"{prefix}.{name}" if prefix else name, owner, name, param)
                 for prefix, owner in module.named_modules(remove_duplicate=False)
                 for name, param in owner._parameters.items() if isinstance(param, DTensor)]
        for full_name, owner, name, param in found:
            if id(param) not in made:
                local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                if local.requires_grad:
                    local.register_hook(_waited)
                spec = SliceSpec(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()),
                                 tuple(local.shape))
                made[id(param)] = (local, spec)
                if spec.split:
                    self.split_ids.add(id(local))
            local, spec = made[id(param)]
            owner._parameters[name] = local
            self.specs[full_name] = spec
            self._views[(id(owner), name)] = (owner, name, local, spec)
        meshes: list[Any] = []
        for spec in self.specs.values():
            if not any(spec.mesh == m for m in meshes):
                meshes.append(spec.mesh)
        if len(meshes) > 1:
            raise user_error("MirroredStrategy's tensor parallelism splits parameters over one tp mesh", f"{len(meshes)} meshes",
                             "Apply the plan through MirroredStrategy(mesh=..., tp_plan=...), not parallelize_module by hand.")
        #: The tp processes' group (None: nothing was split).
        self.group: Any = meshes[0].get_group() if meshes else None
        self.install_views()
        module.register_forward_pre_hook(self._before_forward)

    def install_views(self) -> None:
        """Give each module a DTensor view of its slices under their names (what its forward reads)."""
        from torch.distributed.tensor import DTensor

        for owner, name, local, spec in self._views.values():
            owner.__dict__[name] = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                                      shape=spec.shape, stride=spec.stride)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        self.install_views()  # fresh views: this forward's graph leads from them to the slices

    # --- state ----------------------------------------------------------------------------------------
    def full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which ``tensor`` is this process's slice, as parameter ``name`` is split; a collective
        over tp (every process calls it for the same names, in the same order)."""
        from torch.distributed.tensor import DTensor

        spec = self.specs[name]
        if not spec.split:
            return tensor.detach()
        with collective(f"strategy.state_dict: gathering {name} over tp"):
            return DTensor.from_local(tensor.detach(), spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=spec.stride).full_tensor()

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This process's slice of ``tensor``, the whole of parameter ``name`` (any other shape is left for the load to
        refuse); no communication."""
        from torch.distributed.tensor import distribute_tensor

        spec = self.specs[name]
        if not spec.split or tuple(tensor.shape) != tuple(spec.shape):
            return tensor
        return distribute_tensor(tensor.detach(), spec.mesh, spec.placements, src_data_rank=None).to_local()

    def _per_element(self, name: str, value: Any) -> bool:
        """Whether optimizer state ``value`` of parameter ``name`` is laid out like its slice (momentum, Adam's moments)."""
        return (name in self.specs and isinstance(value, torch.Tensor) and value.dim() > 0
                and tuple(value.shape) == self.specs[name].local_shape)

    def full_model_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict()`` of the module with every slice gathered into its whole tensor (a collective over tp)."""
        return {k: self.full(k, v) if k in self.specs and isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def cut_model_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A whole ``state_dict`` (from any strategy or a plain model) with this process's slices of the split tensors."""
        return {k: self.cut(k, v) if k in self.specs and isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def full_optimizer_state(self, state: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """An optimizer state keyed by parameter name with the per-element state of split parameters gathered whole."""
        if state is None:
            return None
        gathered = {name: {k: self.full(name, v) if self._per_element(name, v) else v for k, v in entry.items()}
                    for name, entry in state.get("state", {}).items()}
        return {**state, "state": gathered}

    def cut_optimizer_state(self, state: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """An optimizer state keyed by parameter name, whole, cut to this process's slices."""
        if state is None:
            return None
        cut = {name: {k: self.cut(name, v) if name in self.specs and isinstance(v, torch.Tensor) and v.dim() > 0 else v
                      for k, v in entry.items()} for name, entry in state.get("state", {}).items()}
        return {**state, "state": cut}


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float, slices: list[TensorParallelSlices]) -> torch.Tensor:
    """The ``norm_type`` norm of the whole gradient of ``parameters``, some of them ``slices``' slices: the split ones'
    terms summed over tp (one all-reduce), the others' counted once; the same on every process."""
    norm_type = float(norm_type)
    split_ids = set().union(*(s.split_ids for s in slices))
    groups = [s.group for s in slices if s.group is not None]
    split: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    for p in parameters:
        if p.grad is not None:
            (split if id(p) in split_ids else whole).append(p.grad.detach())
    device = next((g.device for g in split + whole), torch.device("cpu"))

    def norms(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros(1, device=device)
        return torch.stack([torch.linalg.vector_norm(g, norm_type).float() for g in grads])

    infinite = math.isinf(norm_type)
    mine = norms(split).max() if infinite else norms(split).pow(norm_type).sum()
    if groups:
        with collective("strategy.clip_grad_norm_: the gradient norm over tp"):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=groups[0])
    if infinite:
        return torch.maximum(mine, norms(whole).max())
    return (mine + norms(whole).pow(norm_type).sum()).pow(1.0 / norm_type)


def slice_gradient_guard(model: nn.Module, mesh: str) -> StageGradientGuard:
    """A guard that notes ``model``'s slice gradients once each backward is over, DDP's all-reduce included, and refuses
    an optimizer step after torch's own ``clip_grad_norm_`` (or any in-place rescale) changed them: torch measures the
    slices this process holds, not the whole model, and each process would scale by a factor of its own."""
    guard = StageGradientGuard(
        mesh, lambda changed: changed,  # every process runs the same step: each refuses it alike
        situation="under MirroredStrategy with a tensor-parallel mesh each process holds its slices of the split "
                  "layers as plain tensors, so a norm taken there is this process's, not the model's, and every "
                  "process would scale its gradients by a factor of its own", after="the backward",
        aside="torch's own clip sees the whole gradient under --strategy sharded with the same mesh (its "
              "gradients are DTensors) and without a tp mesh.")
    params = [p for p in model.parameters() if p.requires_grad]
    queued = {"now": False}

    def note_after_ddp() -> None:  # after DDP's own callback, which finalises the sums
        queued["now"] = False
        guard.note(params)

    def on_grad(_param: torch.Tensor) -> None:
        if not queued["now"]:
            queued["now"] = True
            queue_after_backward(note_after_ddp)

    for param in params:
        param.register_post_accumulate_grad_hook(on_grad)
    return guard


def check_tensor_parallel_options(spec: Any, precision: Any, compression: str | None, sync_batchnorm: bool) -> None:
    """Refuse, before the group is joined, what MirroredStrategy cannot run with a tp mesh: each with its reason and
    the fix.

    Args:
        spec: the resolved mesh (``towers.cluster.mesh.MeshSpec``).
        precision: the strategy's ``Precision``.
        compression: the gradient compression asked for.
        sync_batchnorm: whether SyncBatchNorm was asked for.

    Raises:
        ValueError: pp in the mesh, PowerSGD, SyncBatchNorm or fp16 with tp.
    """
    mesh = f"mesh {spec.given()}"
    if spec.pp > 1:
        raise user_error("MirroredStrategy does not cut a model into pipeline stages", mesh,
                         "Use --strategy sharded for pipeline stages (FullyShardedStrategy(mesh=...)), or leave pp "
                         "out of the mesh.")
    if compression == "powersgd":
        raise user_error("gradient_compression='powersgd' cannot run with a tp mesh: its low-rank approximation "
                         "would be of each process's slice of a layer, not of the layer",
                         f"gradient_compression='powersgd', {mesh}",
                         "Use gradient_compression='bf16' or 'fp16' (or none), or drop tp from the mesh.")
    if sync_batchnorm:
        raise user_error("sync_batchnorm cannot run with a tp mesh: its statistics are summed over every process, "
                         "and the tp processes of one replica hold the same examples", f"sync_batchnorm=True, {mesh}",
                         "Drop sync_batchnorm, or drop tp from the mesh.")
    if precision.needs_loss_scaling:
        raise user_error("precision='fp16' cannot run with a tp mesh: its loss scaler's overflow check would see "
                         "one slice of each layer's gradient, so the processes of a replica could skip different "
                         "steps", f"precision={precision.name!r}, {mesh}",
                         "Use precision='bf16' (no loss scaling) or '32', or --strategy sharded.")
