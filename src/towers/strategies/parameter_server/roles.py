"""Who is a ps task and who is a worker: the last ``num_ps`` ranks are ps tasks, the rest are workers.

This is ``towers.cluster``'s order for ``towers launch --num-ps K`` and TF_CONFIG alike
(chief, workers, then ps), so rank 0 stays the chief worker. Under Ray Train the ps tasks are the last
Ray workers of the ``TorchTrainer`` (``towers.cluster.ray``).
"""

from __future__ import annotations

from dataclasses import dataclass

from towers.cluster import roles
from towers.cluster.info import ProcessInfo
from towers.cluster.ray import ps_task_started
from towers.errors import InvalidArgumentError

__all__ = ["Roles", "resolve_roles"]

_LAUNCH_HINT = "towers launch --strategy ps --num-ps 1 --nproc-per-node 3 script.py"


@dataclass(frozen=True)
class Roles:
    """This process's role (``ps`` or ``worker``) and index, the counts, the ps ranks and the address to bind."""

    is_ps: bool
    index: int
    num_ps: int
    num_workers: int
    ps_ranks: tuple[int, ...]
    bind_host: str


def resolve_roles(info: ProcessInfo, num_ps: int | None) -> Roles:
    """Return this process's ``Roles`` for a job of ``info.world_size`` processes with ``num_ps`` ps tasks.

    Raises:
        ValueError: ``num_ps`` < 1, leaves no worker, or contradicts what the launcher / TF_CONFIG set up.
    """
    if info.is_evaluator:
        raise InvalidArgumentError("This process is a TF_CONFIG 'evaluator' task, which takes no part in parameter-server "
                                   "training. Build a OneDeviceStrategy there (towers.strategy_from_env() does) instead.")
    launched = info.cluster.num_tasks("ps") or info.num_ps
    if num_ps is None:
        num_ps = launched or 1
    elif launched and num_ps != launched:
        raise InvalidArgumentError(f"num_ps={num_ps} was passed, but the job was launched with {launched} ps task(s) "
                                   "(--num-ps / TF_CONFIG). Drop num_ps to use the launcher's value, or launch with "
                                   f"--num-ps {num_ps}.")
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
        raise InvalidArgumentError(f"num_ps must be an integer >= 1. Received: num_ps={num_ps!r}. "
                                   "A parameter-server job needs at least one ps task.")
    world = info.world_size
    roles.check_num_ps(num_ps, world, hint=_LAUNCH_HINT)
    ps_ranks = roles.ps_ranks(world, num_ps)
    num_workers = world - num_ps
    role, index = roles.process_role(info.rank, world, num_ps)
    is_ps = role == "ps"
    if info.task.type == "ps" and (not is_ps or info.task.index != index):
        raise InvalidArgumentError(f"This process is task ps:{info.task.index} but has rank {info.rank}; with {num_ps} ps "
                                   f"task(s) among {world} processes the ps tasks must be the last ranks "
                                   f"{list(range(num_workers, world))}. List chief and workers before ps tasks.")
    if is_ps:
        ps_task_started(info, index, num_workers, num_ps)  # under Ray Train: refused outside towers.ray.train_loop, else noted
    return Roles(is_ps=is_ps, index=index, num_ps=num_ps, num_workers=num_workers,
                 ps_ranks=ps_ranks, bind_host=_bind_host(info))


def _bind_host(info: ProcessInfo) -> str:
    """The address this process's links listen on: its TF_CONFIG host, loopback on one host, else the default."""
    addresses = info.cluster.addresses(info.task.type)
    if info.task.index < len(addresses):
        host = addresses[info.task.index].rsplit(":", 1)[0].strip("[]")
        if host:
            return host
    if info.local_world_size == info.world_size:
        return "127.0.0.1"
    return ""  # Gloo's default device: this host's name
