"""Worker collectives through ps task 0 (``reduce``, ``gather``, ``barrier``, object exchange).

The same interface as the synchronous strategies' ``ProcessGroupComm``, but every value travels
to ps task 0 and back (see ``gather.py``): no collective runs among the workers themselves, so a
dead worker in ``async`` mode does not break them. Results then cover the live workers only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from towers.diagnostics import track
from towers.process_group import DistributedError
from towers.strategies._collectives import float_for_mean, local_reduce
from towers.strategies.parameter_server.client import ParameterClient

__all__ = ["PsComm"]

#: How the workers' stacked values combine, per reduce op.
_REDUCERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda t: t.sum(0), "mean": lambda t: t.mean(0), "max": lambda t: t.amax(0), "min": lambda t: t.amin(0)}


class PsComm:
    """Collectives of the workers, met at ps task 0; results come back on ``device``."""

    def __init__(self, client: ParameterClient, *, device: torch.device):
        self.client, self.device = client, device
        self.rank = client.worker

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every live worker's ``obj``, in worker order."""
        with track("strategy.all_gather_object"):
            return self._gather_objects(obj)

    def _gather_objects(self, obj: Any) -> list[Any]:
        return [value for _, value in self.client.all_gather(obj)]

    def reduce(self, op: str, value: torch.Tensor, axis: int | None) -> torch.Tensor:
        """Combine ``value`` over the live workers (``axis``: also over that axis, a true mean over ragged batches)."""
        with track(f"strategy.reduce({op!r})"):
            return self._reduce(op, value, axis)

    def _reduce(self, op: str, value: torch.Tensor, axis: int | None) -> torch.Tensor:
        if axis is None:
            stacked = torch.stack(self._gather_objects((float_for_mean(value) if op == "mean" else value).cpu()))
            return _REDUCERS[op](stacked).to(self.device)
        local, count = local_reduce(op, float_for_mean(value) if op == "mean" else value, axis)
        parts = self._gather_objects((local.cpu(), None if count is None else count.cpu()))
        values = torch.stack([v for v, _ in parts])
        if op == "mean":
            return (values.sum(0) / sum(c for _, c in parts)).to(self.device)
        return _REDUCERS[op](values).to(self.device)

    def gather(self, value: torch.Tensor, axis: int) -> torch.Tensor:
        """Concatenate every live worker's ``value`` along ``axis`` (ragged sizes allowed)."""
        with track("strategy.gather"):
            return torch.cat(self._gather_objects(value.detach().cpu()), dim=axis).to(self.device)

    def barrier(self) -> None:
        """Return once every live worker called ``barrier``."""
        with track("strategy.barrier"):
            self.client.all_gather(None)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Return worker ``src``'s ``obj``."""
        with track("strategy.broadcast_object"):
            values = dict(self.client.all_gather(obj if self.rank == src else None))
        if src not in values:
            raise DistributedError(f"[rank {self.client.rank}/{self.client.world_size}] broadcast_object: worker "
                                   f"{src} is gone, so it has nothing to send. Broadcast from a live worker.")
        return values[src]
