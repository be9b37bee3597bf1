"""How replicas talk outside DDP: ``reduce``, ``gather``, ``barrier`` and object exchange.

``LocalComm`` is the one-replica version (no process group); ``ProcessGroupComm`` uses the
default process group. Every method is a collective under ``ProcessGroupComm``: all replicas
call it in the same order.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from towers.diagnostics import track
from towers.process_group import collective
from towers.strategies.base import REDUCE_OPS

__all__ = ["LocalComm", "ProcessGroupComm", "check_op", "as_tensor"]

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def check_op(op: str) -> str:
    """Return ``op`` lower-cased when it is one of ``REDUCE_OPS``.

    Raises:
        ValueError: naming the accepted reductions.
    """
    key = str(op).lower()
    if key not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}. Received: {op!r}. Use 'sum' or 'mean' for losses.")
    return key


def as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """Return ``value`` as a detached tensor on ``device`` (numbers become 0-d tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, (int, float, bool)):
        return torch.tensor(value, device=device)
    raise TypeError(
        f"strategy.reduce expects a tensor or a number (what strategy.run returned). Received: {type(value).__name__}. "
        "Return a tensor from the step function, or reduce each tensor of a structure separately.")


def _local_reduce(op: str, value: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reduce over ``axis`` of this replica's value; for "mean" also return the count (ragged batches)."""
    if op in ("sum", "mean"):
        total = value.sum(dim=axis)
        return total, (torch.tensor(value.shape[axis], dtype=total.dtype, device=value.device) if op == "mean" else None)
    if value.shape[axis] == 0:  # an empty share: the identity of max/min
        shape = value.shape[:axis] + value.shape[axis + 1:]
        if value.is_floating_point():
            fill = float("-inf") if op == "max" else float("inf")
        else:
            info = torch.iinfo(value.dtype)
            fill = info.min if op == "max" else info.max
        return torch.full(shape, fill, dtype=value.dtype, device=value.device), None
    return (value.amax(dim=axis) if op == "max" else value.amin(dim=axis)), None


def _float_for_mean(value: torch.Tensor) -> torch.Tensor:
    return value if value.is_floating_point() or value.is_complex() else value.double()


class LocalComm:
    """Collectives for a single replica: every value is already the result."""

    num_replicas = 1
    rank = 0

    def reduce(self, op: str, value: torch.Tensor, axis: int | None) -> torch.Tensor:
        if axis is None:
            return value.clone() if op != "mean" else _float_for_mean(value).clone()
        if op == "mean":
            return _float_for_mean(value).mean(dim=axis)
        return _local_reduce(op, value, axis)[0]

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        return None

    def gather(self, value: torch.Tensor, axis: int) -> torch.Tensor:
        return value

    def barrier(self) -> None:
        return None

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class ProcessGroupComm:
    """Collectives over the default process group (gloo or nccl)."""

    def __init__(self, *, rank: int, num_replicas: int, backend: str, timeout_s: float):
        self.rank, self.num_replicas, self.backend, self.timeout_s = rank, num_replicas, backend, timeout_s

    def reduce(self, op: str, value: torch.Tensor, axis: int | None) -> torch.Tensor:
        with collective(f"strategy.reduce({op!r})"), track(f"strategy.reduce({op!r})"):
            if axis is None:
                out = (_float_for_mean(value) if op == "mean" else value).clone()
                dist.all_reduce(out, op=_DIST_OPS[op])
                return out / self.num_replicas if op == "mean" else out
            local, count = _local_reduce(op, _float_for_mean(value) if op == "mean" else value, axis)
            if count is None:
                dist.all_reduce(local, op=_DIST_OPS[op])
                return local
            # One all-reduce for the sums and the example count: a true mean over ragged batches.
            packed = torch.cat([local.reshape(-1), count.reshape(1).to(local.dtype)])
            dist.all_reduce(packed)
            return (packed[:-1] / packed[-1]).reshape(local.shape)

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        with collective("fp16 inf/NaN check"), track("fp16 inf/NaN check"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)

    def gather(self, value: torch.Tensor, axis: int) -> torch.Tensor:
        with collective("strategy.gather"), track("strategy.gather"):
            value = value.detach().contiguous()
            size = torch.tensor([value.shape[axis]], dtype=torch.long, device=value.device)
            sizes = [torch.zeros_like(size) for _ in range(self.num_replicas)]
            dist.all_gather(sizes, size)
            lengths = [int(s.item()) for s in sizes]
            longest = max(lengths)
            if value.shape[axis] < longest:  # pad ragged shares to one shape for all_gather, cut after
                pad_shape = list(value.shape)
                pad_shape[axis] = longest - value.shape[axis]
                value = torch.cat([value, value.new_zeros(pad_shape)], dim=axis)
            parts = [torch.empty_like(value) for _ in range(self.num_replicas)]
            dist.all_gather(parts, value)
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, lengths)], dim=axis)

    def barrier(self) -> None:
        with collective("strategy.barrier"), track("strategy.barrier"):
            if self.backend == "gloo":
                # Names the rank(s) that did not arrive when the timeout expires.
                dist.monitored_barrier(timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
            else:
                dist.barrier()

    def broadcast_object(self, obj: Any, src: int) -> Any:
        with collective("strategy.broadcast_object"), track("strategy.broadcast_object"):
            box = [obj if self.rank == src else None]
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        with collective("strategy.all_gather_object"), track("strategy.all_gather_object"):
            out: list[Any] = [None] * self.num_replicas
            dist.all_gather_object(out, obj)
        return out
