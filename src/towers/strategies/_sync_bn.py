"""SyncBatchNorm that also works on CPU replicas (gloo).

torch's ``nn.SyncBatchNorm`` raises on CPU tensors ("expected input tensor to be on GPU"), and
its kernels (``batch_norm_stats`` & co.) have no CPU implementation. ``CpuSyncBatchNorm`` keeps
the state dict of torch's BatchNorm layers, and on CPU computes the same statistics with
portable ops: one all-reduce of per-channel ``(sum, sum of squares, count)`` in float64 in the
forward pass, one all-reduce of ``(sum dy, sum dy*xhat)`` in the backward pass. On GPUs it is
torch's own implementation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from towers.errors import InvalidArgumentError

__all__ = ["CpuSyncBatchNorm", "convert_sync_batchnorm"]


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,  # type: ignore[override]
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                eps: float, momentum: float, group: Any) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xd = x.detach().double()
        stats = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() // max(channels, 1)], dtype=torch.float64)])
        dist.all_reduce(stats, group=group)  # every replica, even one with an empty batch, joins
        count = float(stats[-1])
        if count <= 1:
            raise InvalidArgumentError(
                f"BatchNorm needs more than 1 value per channel over all replicas when training. Received: {count:g}. "
                "Use a larger global batch (or drop_remainder=True).")
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var * count / (count - 1)).to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        mean_x, invstd_x = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        xhat = (x - mean_x) * invstd_x
        ctx.save_for_backward(xhat, weight, invstd_x)
        ctx.count, ctx.group = count, group
        out = xhat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, weight, invstd = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [0, *range(2, xhat.dim())]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        sum_dy = grad_out.sum(dims)
        sum_dy_xhat = (grad_out * xhat).sum(dims)
        grad_weight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # The input gradient depends on the statistics of the whole global batch.
            both = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(both, group=ctx.group)
            mean_dy = (both[:channels] / ctx.count).to(grad_out.dtype).view(shape)
            mean_dy_xhat = (both[channels:] / ctx.count).to(grad_out.dtype).view(shape)
            scale = invstd if weight is None else invstd * weight.view(shape)
            grad_x = (grad_out - mean_dy - xhat * mean_dy_xhat) * scale
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class CpuSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover every replica's batch, on CPU tensors (gloo).

    Not a subclass of ``nn.SyncBatchNorm``: DDP refuses those on CPU modules.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise InvalidArgumentError(f"SyncBatchNorm expects input of at least 2 dimensions [batch, channels, ...]. Received: "
                                       f"{input.dim()}-D input of shape {list(input.shape)}. Pass batches with a channel "
                                       "dimension.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Return batch-normalised ``input`` with statistics over every replica's batch (in training)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not (bn_training and self.training and group is not None and dist.get_world_size(group) > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                            self.eps, factor, group)


def _to_cpu_sync(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CpuSyncBatchNorm):
        out = CpuSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                               module.track_running_stats, getattr(module, "process_group", None))
        # Share the tensors, so an optimizer built on the original parameters keeps working.
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _to_cpu_sync(child))
    return out


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Return ``module`` with every BatchNorm layer synchronised across replicas, sharing its tensors.

    GPUs get torch's ``nn.SyncBatchNorm``; CPUs get ``CpuSyncBatchNorm``.
    """
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _to_cpu_sync(module)
