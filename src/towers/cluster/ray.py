"""A worker of Ray Train's ``TorchTrainer``: Ray made the process group and set torchrun's variables.

Ray Train's torch backend starts one Ray actor per worker, sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in it (its rank 0 hosts the store at
that port), and calls ``torch.distributed.init_process_group`` before the training function runs. towers
builds on that group and never makes a second one (``towers.process_group.init_process_group`` returns at
once when a group exists). A Ray worker is told from a torchrun worker by Ray's own ``RAY_JOB_ID`` without
torchrun's ``TORCHELASTIC_RUN_ID`` (torchrun started inside a Ray task is torchrun's job, not Ray's).

Roles are torchrun's: rank 0 is the chief and, with ``TOWERS_NUM_PS=K`` (or a strategy built with
``num_ps=K``), the last K ranks are ps tasks, which live as Ray workers of the same ``TorchTrainer``.

Under parameter servers a ps task serves inside the strategy's constructor and then ends its training
function; Ray counts a function that raises (``SystemExit`` too) as a failed worker, and expects every worker
to take part in each ``ray.train.report``. So a ps task needs the loop that ``towers.ray.train_loop`` wraps
around the user's function: it ends the function cleanly and takes the ps task's part in the chief's
reports. This module holds only the seam (a context variable the wrapper sets, ``ps_task_started``), so
``cluster/`` stays free of Ray and of torch. A Ray worker's process outlives its training function, so what towers runs at a
process's exit elsewhere (a parameter-server worker's goodbye to the ps tasks) runs when the wrapped
function ends (``at_loop_end``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, Mapping, Protocol

from towers._logging import get_logger
from towers.cluster.base import ClusterEnvironment
from towers.cluster.info import ProcessInfo
from towers.cluster.torchrun import TorchrunEnvironment
from towers.errors import FailedPreconditionError

__all__ = ["RayTrainEnvironment", "RayLoop", "current_ray_loop", "ray_loop_scope", "ps_task_started", "at_loop_end",
           "RAY_SOURCE", "INSTALL_HINT"]

log = get_logger(__name__)

#: ``ProcessInfo.source`` of a Ray Train worker.
RAY_SOURCE = "ray"
#: How to install what towers' Ray integration needs.
INSTALL_HINT = "pip install 'towers[ray]'  (or: pip install \"ray[train]==2.60.0\")"


class RayTrainEnvironment(ClusterEnvironment):
    """Reads the torchrun variables Ray Train's torch backend sets in each worker (``source == "ray"``)."""

    name = RAY_SOURCE

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True in a Ray worker (``RAY_JOB_ID``) given ``RANK``/``WORLD_SIZE``, not under torchrun."""
        return ("RAY_JOB_ID" in environ and "RANK" in environ and "WORLD_SIZE" in environ
                and "TORCHELASTIC_RUN_ID" not in environ)

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this worker's ``ProcessInfo``; raises ``ClusterConfigError`` on bad values."""
        info = TorchrunEnvironment().process_info(environ)
        # Ray restarts a failed group as a new job (a new store at a new port): no attempt count, no agent store.
        return dataclasses.replace(info, source=self.name, restart_count=0, agent_store=False)


class RayLoop(Protocol):
    """What ``towers.ray.train_loop`` does for a ps task of the function it wraps."""

    def ps_task_started(self, info: ProcessInfo) -> None:
        """Called on a ps task before it serves: take its part in the workers' ``ray.train.report`` calls."""

    def at_end(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the wrapped function ends (what towers runs at a process's exit elsewhere)."""


_CURRENT: contextvars.ContextVar[RayLoop | None] = contextvars.ContextVar("towers_ray_loop", default=None)


def current_ray_loop() -> RayLoop | None:
    """Return the ``towers.ray.train_loop`` this code runs in, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def ray_loop_scope(loop: RayLoop) -> Iterator[None]:
    """Make ``loop`` current for the block (``towers.ray.train_loop`` runs the user's function inside it)."""
    token = _CURRENT.set(loop)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def ps_task_started(info: ProcessInfo, index: int, num_workers: int, num_ps: int) -> None:
    """Note that this Ray worker is ps task ``index`` of ``num_ps``, beside ``num_workers`` workers (a no-op outside Ray).

    Raises:
        FailedPreconditionError: under Ray Train outside ``towers.ray.train_loop``: the ps task could neither end
            its training function cleanly nor take part in Ray's reports.
    """
    if info.source != RAY_SOURCE:
        return
    loop = current_ray_loop()
    if loop is None:
        raise FailedPreconditionError(
            f"Rank {info.rank} is ps task {index} of a parameter-server job under Ray Train, but the training function "
            "is not wrapped by towers.ray.train_loop. A ps task serves inside the strategy's constructor and then "
            "ends the function, which Ray would count as a failed worker. Received: a bare train_loop_per_worker. "
            "Fix: TorchTrainer(towers.ray.train_loop(train_func), scaling_config=ScalingConfig(num_workers="
            f"{num_workers + num_ps})): {num_workers} worker(s) and {num_ps} ps task(s), all Ray workers.")
    log.info("rank %d/%d is ps task %d (a Ray Train worker), serving %d worker(s)", info.rank, info.world_size, index,
             num_workers)
    loop.ps_task_started(info)


def at_loop_end(callback: Callable[[], None]) -> bool:
    """Run ``callback`` when the ``towers.ray.train_loop`` this code runs in ends; return False outside one."""
    loop = current_ray_loop()
    if loop is None:
        return False
    loop.at_end(callback)
    return True
