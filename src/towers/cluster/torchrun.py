"""torchrun (``torch.distributed.run``, which ``towers launch`` uses) and Kubeflow PyTorchJob variables.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node rank),
``MASTER_ADDR`` and ``MASTER_PORT`` for every worker. A Kubeflow PyTorchJob without torchrun sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for its one process per pod; then
``local_rank`` is 0 of 1 and the node rank is the rank.

Under torchrun's agent, ``TORCHELASTIC_RESTART_COUNT`` counts restarts and
``TORCHELASTIC_USE_AGENT_STORE=True`` says the agent hosts the rendezvous store.

With ``TOWERS_NUM_PS=K`` (``towers launch --num-ps K``) the last K ranks are parameter servers,
the same order as TF_CONFIG's (chief/workers first, ps last).
"""

from __future__ import annotations

from typing import Mapping

from towers.cluster.base import ClusterConfigError, ClusterEnvironment, env_int, launch_options, role_of_rank
from towers.cluster.info import ProcessInfo

__all__ = ["TorchrunEnvironment", "read_master"]


def read_master(environ: Mapping[str, str], default_addr: str = "127.0.0.1",
                default_port: int | None = None) -> tuple[str, int | None]:
    """Return ``(MASTER_ADDR, MASTER_PORT)`` from ``environ``, with defaults when unset.

    Raises:
        ClusterConfigError: when ``MASTER_PORT`` is not a port number.
    """
    addr = environ.get("MASTER_ADDR", "").strip() or default_addr
    if environ.get("MASTER_PORT", "").strip():
        port = env_int(environ, "MASTER_PORT", minimum=1)
        if port > 65535:
            raise ClusterConfigError(f"MASTER_PORT must be a port in 1..65535. Received: MASTER_PORT={port}. "
                                     "Pick a free port, e.g. with `towers launch` (it picks one).")
        return addr, port
    return addr, default_port


class TorchrunEnvironment(ClusterEnvironment):
    """Reads torchrun's / Kubeflow's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ... variables."""

    name = "torchrun"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when both ``RANK`` and ``WORLD_SIZE`` are set."""
        return "RANK" in environ and "WORLD_SIZE" in environ

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this process's ``ProcessInfo``; raises ``ClusterConfigError`` on bad values."""
        world_size = env_int(environ, "WORLD_SIZE", minimum=1)
        rank = env_int(environ, "RANK")
        if rank >= world_size:
            raise ClusterConfigError(
                f"RANK must be < WORLD_SIZE. Received: RANK={rank}, WORLD_SIZE={world_size}. "
                "Fix the launcher that set them (ranks count from 0).")
        if "LOCAL_RANK" in environ:
            local_rank = env_int(environ, "LOCAL_RANK")
            # Without LOCAL_WORLD_SIZE (legacy torch.distributed.launch) assume one node.
            local_world_size = env_int(environ, "LOCAL_WORLD_SIZE", world_size, minimum=1)
        else:  # Kubeflow without torchrun: one process per pod
            local_rank, local_world_size = 0, env_int(environ, "LOCAL_WORLD_SIZE", 1, minimum=1)
        if local_rank >= local_world_size:
            raise ClusterConfigError(
                f"LOCAL_RANK must be < LOCAL_WORLD_SIZE. Received: LOCAL_RANK={local_rank}, "
                f"LOCAL_WORLD_SIZE={local_world_size}. Fix the launcher that set them.")
        default_node = rank // local_world_size
        node_rank = env_int(environ, "GROUP_RANK", env_int(environ, "NODE_RANK", default_node))
        master_addr, master_port = read_master(environ)
        strategy, num_ps = launch_options(environ)
        task = role_of_rank(rank, world_size, num_ps)
        return ProcessInfo(rank=rank, world_size=world_size, local_rank=local_rank,
                           local_world_size=local_world_size, node_rank=node_rank, master_addr=master_addr,
                           master_port=master_port, task=task, source=self.name, strategy=strategy,
                           num_ps=num_ps, chief_rank=0,
                           restart_count=env_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
                           agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip() == "True")
