"""The collectives of a ParameterServerStrategy: met at ps task 0 (``comm.py``), over the live workers only."""

from __future__ import annotations

from typing import Any

import torch

from towers.cluster.info import ProcessInfo
from towers.errors import FailedPreconditionError, InvalidArgumentError
from towers.strategies._collectives import as_tensor, check_op
from towers.strategies.base import Strategy
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.comm import PsComm
from towers.strategies.parameter_server.roles import Roles

__all__ = ["WorkerCollectives"]


class WorkerCollectives(Strategy):
    """``reduce``/``gather``/``barrier`` and the object exchange, which run on workers only (a round trip to ps task 0)."""

    _info: ProcessInfo
    roles: Roles
    _client: ParameterClient | None
    _comm: PsComm | None

    def _require_worker(self, what: str) -> ParameterClient:
        if self._client is None:
            raise FailedPreconditionError(f"{what} runs on workers; this process is ps task {self.roles.index} (rank "
                                          f"{self._info.rank}). Guard ps-task code with `if strategy.is_ps`.")
        return self._client

    def _comm_or_fail(self, what: str) -> PsComm:
        self._require_worker(what)
        return self._comm  # type: ignore[return-value]  # set together with the client

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` over the workers with ``op``; after a worker died: over the live ones.

        Raises:
            ValueError: on an unknown op or an axis the value does not have.
        """
        op = check_op(op)
        tensor = as_tensor(value, torch.device("cpu"))
        if axis is not None and (tensor.dim() == 0 or not -tensor.dim() <= axis < tensor.dim()):
            raise InvalidArgumentError(f"axis must be None or a dimension of the value (shape {list(tensor.shape)}). "
                                       f"Received: axis={axis}. Use axis=0 to reduce over the batch.")
        if axis is not None and axis < 0:
            axis += tensor.dim()
        return self._comm_or_fail("reduce").reduce(op, tensor, axis)

    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every live worker's ``value`` along ``axis``, in worker order."""
        tensor = as_tensor(value, torch.device("cpu"))
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        return self._comm_or_fail("gather").gather(tensor, axis if axis >= 0 else axis + tensor.dim())

    def barrier(self) -> None:
        """Block until every live worker reaches this point (a round trip to ps task 0)."""
        self._comm_or_fail("barrier").barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return worker ``src``'s ``obj`` on every worker."""
        return self._comm_or_fail("broadcast_object").broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every live worker's ``obj``, in worker order."""
        return self._comm_or_fail("all_gather_object").all_gather_object(obj)
