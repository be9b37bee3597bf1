"""Tensor-parallel styles for Hugging Face's ``Conv1D`` (GPT-2's linear layers), whose weight is ``(in, out)``.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` split ``nn.Linear`` (weight ``(out, in)``) only. GPT-2's
layers are ``Conv1D``: ``y = x @ W + b`` with ``W`` of shape ``(in, out)``, and its attention packs the
query, key and value projections into one ``c_attn`` of ``3 * n_embd`` outputs. Here:

- ``"conv1d_colwise"`` splits the outputs: ``W`` sharded on dim 1, ``b`` on dim 0; each process
  computes its slice of the outputs. For ``c_attn`` (``"conv1d_colwise_qkv"``) the split takes the
  same heads from each of q, k and v (a strided shard: q's slice, k's slice, v's slice), so each
  process holds whole heads, and the attention's ``split_size`` becomes the process's width (GPT-2's
  attention reads its head count from the tensor). Its bias stays whole on every tp process, which
  uses its slices.
- ``"conv1d_rowwise"`` splits the inputs: ``W`` sharded on dim 0; the partial outputs are summed by one
  all-reduce over tp, then the (replicated) bias is added.

The parameters are DTensors on the tp mesh (checkpoints and FSDP2 see the whole tensors' layout); the
forward computes on the local slices, with the all-reduces of the Megatron layout: a colwise layer's
input gradient and a rowwise layer's output are summed over tp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["CONV1D_STYLES", "Conv1DColwise", "Conv1DRowwise"]


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over tp (the input of a layer split by its outputs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    """Forward sums the partial outputs over tp; backward passes the (replicated) gradient on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local(module: nn.Module, name: str) -> torch.Tensor:
    """This process's slice of ``module``'s DTensor parameter ``name`` (autograd flows to the DTensor)."""
    param: Any = getattr(module, name)
    return param.to_local()


def _distribute(module: nn.Module, name: str, mesh: Any, placement: Any) -> None:
    from torch.distributed.tensor import distribute_tensor

    param = getattr(module, name)
    module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                                 requires_grad=param.requires_grad))


class Conv1DColwise(ParallelStyle):
    """A ``Conv1D`` split by its outputs; ``fused`` equal parts (q, k, v) each split alike."""

    def __init__(self, fused: int = 1):
        super().__init__()
        self.fused = fused

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard  # torch's placement for a strided split

        def split(dim: int) -> Any:
            return Shard(dim) if self.fused == 1 else _StridedShard(dim, split_factor=self.fused)

        from torch.distributed.tensor import Replicate

        _distribute(module, "weight", device_mesh, split(1))
        # A fused bias stays whole on every tp process (FSDP2 cannot shard dim 0 of a tensor strided on dim 0): each
        # takes its slices of q, k and v, and the gradient's slices are summed over tp, so every copy gets all of it.
        _distribute(module, "bias", device_mesh, split(0) if self.fused == 1 else Replicate())
        group, size, rank = device_mesh.get_group(), device_mesh.size(), device_mesh.get_local_rank()

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = _local(module, "weight"), _local(module, "bias")
            if self.fused > 1:
                bias = _SumGradients.apply(bias, group).view(self.fused, size, -1)[:, rank].reshape(-1)
            x = _SumGradients.apply(x, group)
            out = torch.addmm(bias, x.reshape(-1, x.size(-1)), weight)
            return out.view(*x.shape[:-1], weight.shape[1])

        module.forward = forward  # type: ignore[method-assign]
        return module


class Conv1DRowwise(ParallelStyle):
    """A ``Conv1D`` split by its inputs: partial outputs summed over tp, then the bias added."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard

        _distribute(module, "weight", device_mesh, Shard(0))
        _distribute(module, "bias", device_mesh, Replicate())
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = _local(module, "weight"), _local(module, "bias")
            out = _SumOutputs.apply(torch.mm(x.reshape(-1, x.size(-1)), weight), group) + bias
            return out.view(*x.shape[:-1], weight.shape[1])

        module.forward = forward  # type: ignore[method-assign]
        return module


#: The style strings a plan may name for ``Conv1D`` layers.
CONV1D_STYLES = {"conv1d_colwise": Conv1DColwise, "conv1d_colwise_qkv": lambda: Conv1DColwise(fused=3),
                 "conv1d_rowwise": Conv1DRowwise}
