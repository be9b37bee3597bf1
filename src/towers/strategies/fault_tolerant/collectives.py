"""The collectives of a FaultTolerantStrategy: over the live replica groups of the current step's quorum
(``LiveGroupCollectives``, which the strategy holds; its ``reduce``/``gather``/... call these)."""

from __future__ import annotations

from typing import Any

import torch

from towers.strategies._collectives import as_tensor, check_op, local_reduce
from towers.strategies._named import current_named_collective
from towers.strategies.base import PeerLostError
from towers.strategies.fault_tolerant.groups import quorum_started
from towers.strategies.fault_tolerant.steps import QuorumSteps

__all__ = ["LiveGroupCollectives"]


class LiveGroupCollectives:
    """``reduce``/``gather``/``barrier`` and the object exchange, over this group's processes, then the live groups of
    ``quorum``'s step; results on ``device``."""

    def __init__(self, quorum: QuorumSteps, device: torch.device) -> None:
        self._quorum, self._device = quorum, device

    def _all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> torch.Tensor:
        from torch.distributed import ReduceOp

        reduce_op = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]
        quorum, manager = self._quorum, self._quorum.manager
        started = quorum_started(manager)
        if started and current_named_collective() is not None:  # every live group's processes in it, or one error
            quorum.agreement.agree(step=quorum.current_step, expected=quorum.live_replicas)
        if quorum.intra is not None:  # this group's processes first (a lost one fails this at once), then the groups
            import torch.distributed as dist

            dist.all_reduce(tensor, op=reduce_op, group=quorum.intra)
        if not started:  # before the first step: this group alone
            return tensor
        work = manager.allreduce(tensor, reduce_op=reduce_op)
        work.wait()
        if manager.errored():  # the other groups may have gone on while one waits in a named call: that is told
            quorum.agreement.check(step=quorum.current_step, where=f"waited in {what} over the live replica groups")
            raise PeerLostError(f"replica group {quorum.replica_group_id}: {what} failed over the live replica groups: "
                               f"{manager.errored()}. A group was lost since this step's quorum; the next step's "
                               "quorum leaves it out. Call it again after the next step.")
        return tensor

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` over the live groups with ``op`` (see ``Strategy.reduce``)."""
        op = check_op(op)
        tensor = as_tensor(value, self._device)
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.double()
        if axis is None:
            out = self._all_reduce(tensor.clone(), "sum" if op == "mean" else op, f"strategy.reduce({op!r})")
            return out / self._quorum.live_replicas if op == "mean" else out
        axis = axis + tensor.dim() if axis < 0 else axis
        local, count = local_reduce(op, tensor, axis)
        if count is None:
            return self._all_reduce(local, op, f"strategy.reduce({op!r})")
        packed = self._all_reduce(torch.cat([local.reshape(-1), count.reshape(1).to(local.dtype)]), "sum",
                                  f"strategy.reduce({op!r})")
        return (packed[:-1] / packed[-1]).reshape(local.shape)

    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every live group's ``value`` along ``axis`` (ragged sizes allowed), in quorum order."""
        tensor = as_tensor(value, self._device)
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        axis = axis + tensor.dim() if axis < 0 else axis
        n, me = self._quorum.live_replicas, self._quorum.replica_id
        if n == 1:
            return tensor
        sizes = torch.zeros(n, dtype=torch.long)
        sizes[me] = tensor.shape[axis]
        lengths = [int(s) for s in self._all_reduce(sizes, "sum", "strategy.gather")]
        moved = tensor.movedim(axis, 0)
        dtype = torch.uint8 if moved.dtype == torch.bool else moved.dtype
        slab = torch.zeros((n, max(lengths), *moved.shape[1:]), dtype=dtype)
        slab[me, :moved.shape[0]] = moved.to(dtype)
        slab = self._all_reduce(slab, "sum", "strategy.gather")
        out = torch.cat([slab[r, :lengths[r]] for r in range(n)]).to(moved.dtype)
        return out.movedim(0, axis)

    def barrier(self) -> None:
        """Return when every live group reached this point (or raise when one was lost meanwhile)."""
        self._all_reduce(torch.zeros(1), "sum", "strategy.barrier")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every live group's ``obj``, in quorum order (JSON values and tensors: never a pickle).

        Raises:
            TypeError: ``obj`` holds something other than JSON values, tuples and dense tensors.
        """
        from towers.strategies.parameter_server.wire import decode, encode

        n = self._quorum.live_replicas
        if n == 1:
            return [obj]
        raw, tensors = encode(obj)
        blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
        data = torch.cat([torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8),
                          blob])
        gathered = self.gather(data)
        sizes = self.gather(torch.tensor([len(raw), data.numel()]).reshape(1, 2)).reshape(-1, 2).tolist()
        parts, start = [], 0
        for json_bytes, total in sizes:
            part = gathered[start:start + total]
            parts.append(decode(part[:json_bytes].numpy().tobytes(), part[json_bytes:]))
            start += total
        return parts

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return group ``src``'s ``obj`` (its rank in the current quorum) on every live group."""
        return self.all_gather_object(obj if self._quorum.replica_id == src else None)[src]
