"""MPI launchers: Open MPI's ``OMPI_COMM_WORLD_*`` and MPICH/Intel MPI's ``PMI_*`` variables.

``mpirun -np 4 python train.py`` starts the processes; each reads its rank and size from the
launcher's variables. MPI does not say where the rendezvous is: with every process on this host
it is ``127.0.0.1``; across hosts ``MASTER_ADDR`` must be passed (``mpirun -x MASTER_ADDR=host0``).
The port is ``MASTER_PORT`` (required when the job has more than one process). The node rank is
``rank // local size`` (MPI's default by-slot placement: each host's ranks are consecutive).
"""

from __future__ import annotations

from typing import Mapping

from towers.cluster.base import ClusterConfigError, ClusterEnvironment, env_int, launch_options, role_of_rank
from towers.cluster.info import ProcessInfo
from towers.cluster.torchrun import read_master

__all__ = ["MPIEnvironment", "MPI_FLAVOURS"]

#: (rank, size, local rank, local size) variables of each MPI family, in the order they are tried.
MPI_FLAVOURS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _flavour(environ: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    for names in MPI_FLAVOURS:
        if environ.get(names[0], "").strip() and environ.get(names[1], "").strip():
            return names
    return None


class MPIEnvironment(ClusterEnvironment):
    """Reads ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE`` or ``PMI_RANK``/``PMI_SIZE``."""

    name = "mpi"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when an MPI launcher's rank and size variables are set."""
        return _flavour(environ) is not None

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this process's ``ProcessInfo``; raises ``ClusterConfigError`` on bad or missing values."""
        names = _flavour(environ)
        if names is None:
            raise ClusterConfigError("No MPI variables found (OMPI_COMM_WORLD_RANK/SIZE or PMI_RANK/SIZE). "
                                     "Start the script with mpirun.")
        rank_name, size_name, local_rank_name, local_size_name = names
        world_size = env_int(environ, size_name, minimum=1)
        rank = env_int(environ, rank_name)
        if rank >= world_size:
            raise ClusterConfigError(f"{rank_name} must be < {size_name}. Received: {rank_name}={rank}, "
                                     f"{size_name}={world_size}. Fix the launcher that set them.")
        local_rank = env_int(environ, local_rank_name, 0)
        local_world_size = env_int(environ, local_size_name, 1, minimum=1)
        if local_rank >= local_world_size:
            raise ClusterConfigError(f"{local_rank_name} must be < {local_size_name}. Received: {local_rank_name}="
                                     f"{local_rank}, {local_size_name}={local_world_size}.")
        default_addr = "127.0.0.1"
        if world_size > local_world_size and not environ.get("MASTER_ADDR", "").strip():
            raise ClusterConfigError(
                f"MPI started {world_size} processes on several hosts ({local_world_size} on this one) but does not "
                "say where the rendezvous is. Pass MASTER_ADDR (the first host's address) and MASTER_PORT to every "
                "process, e.g. `mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500 ...`.")
        master_addr, master_port = read_master(environ, default_addr)
        if world_size > 1 and master_port is None:
            raise ClusterConfigError(
                f"MPI started {world_size} processes but MASTER_PORT is not set, so they cannot meet. Pass a free "
                "port to every process, e.g. `mpirun -x MASTER_PORT=29500 ...` (and MASTER_ADDR across hosts).")
        strategy, num_ps = launch_options(environ)
        return ProcessInfo(rank=rank, world_size=world_size, local_rank=local_rank,
                           local_world_size=local_world_size, node_rank=rank // local_world_size,
                           master_addr=master_addr, master_port=master_port,
                           task=role_of_rank(rank, world_size, num_ps), source=self.name, strategy=strategy,
                           num_ps=num_ps, chief_rank=0)
