"""The collectives of a ParameterServerStrategy: met at ps task 0 (``comm.py``), over the live workers only.

``WorkerCollectives`` is what the strategy holds and its ``reduce``/``gather``/``barrier``/object exchange call; on a
ps task (no client) each says that it runs on workers.
"""

from __future__ import annotations

from typing import Any

import torch

from towers.cluster.info import ProcessInfo
from towers.errors import FailedPreconditionError, InvalidArgumentError
from towers.strategies._collectives import as_tensor, check_op
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.comm import PsComm
from towers.strategies.parameter_server.roles import Roles

__all__ = ["WorkerCollectives"]


class WorkerCollectives:
    """``reduce``/``gather``/``barrier`` and the object exchange, which run on workers only (a round trip to ps task 0).

    ``client`` is this worker's link to the ps tasks (None on a ps task); results come back on ``device``.
    """

    def __init__(self, roles: Roles, info: ProcessInfo, client: ParameterClient | None, device: torch.device) -> None:
        self._roles, self._info, self._client = roles, info, client
        self._comm = PsComm(client, device=device) if client is not None else None

    def require_worker(self, what: str) -> ParameterClient:
        """This worker's client; on a ps task, an error saying that ``what`` runs on workers."""
        if self._client is None:
            raise self._not_on_a_worker(what)
        return self._client

    def _not_on_a_worker(self, what: str) -> Exception:
        return FailedPreconditionError(f"{what} runs on workers; this process is ps task {self._roles.index} (rank "
                                       f"{self._info.rank}). Guard ps-task code with `if strategy.is_ps`.")

    def _comm_or_fail(self, what: str) -> PsComm:
        if self._comm is None:
            raise self._not_on_a_worker(what)
        return self._comm

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
