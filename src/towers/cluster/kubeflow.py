"""Kubeflow Trainer v2: a pod whose only description is torchrun's ``PET_*`` variables.

Kubeflow Trainer v2 sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` and expects the command to be ``torchrun`` (or
``towers launch``), which reads them as the defaults of its flags and then sets ``RANK``,
``WORLD_SIZE``, ... for its workers (the torchrun source reads those). When the command is a
plain ``python train.py`` instead, this source reads the ``PET_*`` variables directly: with one
process per node the pod is rank ``PET_NODE_RANK`` of ``PET_NNODES``. With more than one process
per node a lone ``python`` cannot be all of them, so that is refused with the fix, instead of
training alone as a one-process job.
"""

from __future__ import annotations

from typing import Mapping

from towers.cluster.base import ClusterConfigError, ClusterEnvironment, env_int, launch_options, role_of_rank
from towers.cluster.info import ProcessInfo

__all__ = ["KubeflowTrainerEnvironment"]


class KubeflowTrainerEnvironment(ClusterEnvironment):
    """Reads Kubeflow Trainer v2's ``PET_*`` variables when no launcher turned them into ``RANK``/``WORLD_SIZE``."""

    name = "kubeflow_trainer"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when ``PET_NNODES`` is set."""
        return bool(environ.get("PET_NNODES", "").strip())

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this pod's ``ProcessInfo``; raises ``ClusterConfigError`` on bad values or several processes per pod."""
        raw_nodes = environ["PET_NNODES"].strip()
        low, _, high = raw_nodes.partition(":")
        if high and high != low:
            raise ClusterConfigError(
                f"PET_NNODES={raw_nodes!r} asks for an elastic node count, which needs torchrun's rendezvous. "
                "Start the command with `torchrun` or `towers launch` (both read PET_*).")
        nnodes = env_int({"PET_NNODES": low}, "PET_NNODES", minimum=1)
        nproc = environ.get("PET_NPROC_PER_NODE", "").strip() or "1"
        if nproc != "1":
            raise ClusterConfigError(
                f"Kubeflow Trainer set PET_NPROC_PER_NODE={nproc!r} for torchrun, but this process was started "
                "without a launcher, so it would be the only process of its pod while the job expects more. Start "
                "the command with `torchrun` or `towers launch` (both read PET_* and start the processes), or "
                "set numProcPerNode: 1.")
        node_rank = env_int(environ, "PET_NODE_RANK", 0 if nnodes == 1 else None)
        if node_rank >= nnodes:
            raise ClusterConfigError(
                f"PET_NODE_RANK must be < PET_NNODES. Received: PET_NODE_RANK={node_rank}, PET_NNODES={nnodes}. "
                "Fix the TrainJob's node count.")
        master_addr = environ.get("PET_MASTER_ADDR", "").strip() or environ.get("MASTER_ADDR", "").strip()
        if not master_addr:
            if nnodes > 1:
                raise ClusterConfigError(
                    f"PET_MASTER_ADDR is not set, so pod {node_rank} of {nnodes} cannot find the rendezvous. Set "
                    "PET_MASTER_ADDR (Kubeflow Trainer sets it) or MASTER_ADDR to node 0's address.")
            master_addr = "127.0.0.1"
        port_variable = "PET_MASTER_PORT" if environ.get("PET_MASTER_PORT", "").strip() else "MASTER_PORT"
        master_port = env_int(environ, port_variable, 0, minimum=0) or None
        if master_port is not None and master_port > 65535:
            raise ClusterConfigError(f"{port_variable} must be a port in 1..65535. Received: {master_port}.")
        strategy, num_ps = launch_options(environ)
        return ProcessInfo(rank=node_rank, world_size=nnodes, node_rank=node_rank, master_addr=master_addr,
                           master_port=master_port, task=role_of_rank(node_rank, nnodes, num_ps), source=self.name,
                           strategy=strategy, num_ps=num_ps, chief_rank=0)
