"""``bitwise=True`` under FSDP2: the tree of ``_bitwise.py`` summed inside FSDP2's own reduce-scatter.

FSDP2 reduce-scatters each unit's gradient at the end of every backward that reaches it: its input is
the unit's whole (unsharded) gradient, laid out as one chunk per rank, its output this rank's chunk of
the sum. ``TreeReduceScatter`` takes that place on every unit:

- on a micro-batch that is not the replica's last of the batch it keeps the input as that
  micro-batch's leaf and writes zeros (FSDP2 adds them to the sharded gradient: nothing changes);
- on the last, it sums its leaves into this replica's subtrees (the same nodes as ``_bitwise.py``),
  sends each rank that rank's chunk of every subtree (one all-to-all: each rank receives the chunks it
  owns), and writes the tree's sum of its chunk. The tree is elementwise, so a chunk summed on its own
  has the bits of the same elements of one device's sum.

FSDP2's divide factor is 1 and its collectives plain sums (``parallel/fsdp.py``): the output is the
sum, as one device's ``p.grad``. Every replica runs as many micro-batches as the one with the most
(``SyncStrategy._run_bitwise``), since each forward all-gathers parameters. The norm a clip takes is
one device's (``clip_whole``): every gradient gathered whole, measured as torch measures it. torch's own
``clip_grad_norm_`` takes the norm from the shards, in another order: an optimizer step after it is refused
(``StageGradientGuard``), naming towers' clip.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from towers.parallel.layout import Layout
from towers.parallel.stage_gradients import StageGradientGuard
from towers.strategies._bitwise import BitwiseSteps
from towers.strategies._loss_weights import queue_after_backward
from towers.strategies.context import check_max_norm

__all__ = ["TreeReduceScatter", "ShardedTree", "clip_whole", "bitwise_refusal"]


class TreeReduceScatter(ReduceScatter):
    """One FSDP2 unit's reduce-scatter under ``bitwise=True``: the sum over the fixed tree of micro-batches."""

    def __init__(self, steps: BitwiseSteps, after: Callable[[], None] | None = None):
        self._steps = steps
        self._after = after  # run as the backward that summed the tree ends (FSDP2 has written the shards then)
        self._leaves: dict[int, torch.Tensor] = {}

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A buffer for FSDP2's input or output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        """Keep this micro-batch's leaf; after the replica's last, write this rank's chunk of the tree's sum."""
        steps = self._steps
        if steps.leaf is not None:
            self._leaves[steps.leaf] = input_tensor.detach().clone()
        if not steps.last:
            output_tensor.zero_()
            return None
        world, chunk = dist.get_world_size(group), output_tensor.numel()
        values = steps.subtrees(self._leaves, lambda: input_tensor.new_zeros(input_tensor.numel()))
        self._leaves = {}
        width = steps.width()
        block = torch.stack(values + [input_tensor.new_zeros(input_tensor.numel())] * (width - len(values)))
        send = block.view(width, world, chunk).transpose(0, 1).contiguous()  # rank r's chunk of every subtree
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        rows = [list(received[r].unbind()) for r in range(world)]
        output_tensor.copy_(steps.root(rows, lambda: output_tensor.new_zeros(chunk)))
        if self._after is not None:
            queue_after_backward(self._after)
        return None


class ShardedTree:
    """``bitwise=True`` under FSDP2, held by the strategy: each prepared model's units sum the tree in their
    reduce-scatter, the clip is one device's, and torch's own clip after the tree is refused at the step."""

    def __init__(self, steps: BitwiseSteps, mesh: str):
        self._steps, self._mesh = steps, mesh
        self._guards: dict[int, StageGradientGuard] = {}

    def install(self, model: nn.Module) -> None:
        """Give every FSDP2 unit of ``model`` its own ``TreeReduceScatter``; note its gradients after each tree."""
        guard = StageGradientGuard(
            self._mesh, lambda changed: changed, after="the backward",
            situation="under FullyShardedStrategy(bitwise=True) torch takes the norm from each process's shards, in "
                      "another order than one device, so the update would not have one device's bits",
            aside="towers' clip gathers each gradient whole and measures it as one device does.")
        self._guards[id(model)] = guard
        params = [p for p in model.parameters() if p.requires_grad]
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(TreeReduceScatter(self._steps, lambda: guard.note(params)))

    def before_step(self, model: nn.Module) -> Callable[[], None] | None:
        """The check the optimizer runs before an update of ``model``: no gradient changed since the tree or the clip."""
        guard = self._guards.get(id(model))
        return None if guard is None else guard.check

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """``clip_whole``; what it leaves is noted as the gradients the step may find."""
        params = list(parameters)
        total = clip_whole(params, max_norm, norm_type)
        for guard in self._guards.values():
            guard.note(p for p in params if p.grad is not None)
        return total


def clip_whole(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
    """Clip as one device clips: the total norm from every gradient gathered whole (a DTensor's ``full_tensor``) by
    torch's ``get_total_norm``, then each shard scaled by torch's factor. Every rank returns the same bits.

    Returns:
        The total norm before clipping.

    Raises:
        ValueError: ``max_norm`` is not a positive finite number.
    """
    check_max_norm(max_norm)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads],
                                          norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's clip_grads_with_norm_
    for g in grads:
        (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
    return total


def bitwise_refusal(layout: Layout, cpu_offload: bool) -> str | None:
    """Why ``bitwise=True`` cannot be exact under FullyShardedStrategy on this layout (None: it can)."""
    if layout.pp * layout.tp > 1 or layout.dp_replicate > 1:
        return f"mesh {layout.describe()}: only plain sharding over every process sums its gradients in the tree"
    if cpu_offload:
        return "cpu_offload=True: the gradients leave the device before the tree"
    return None
