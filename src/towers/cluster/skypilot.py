"""SkyPilot: a job's ``run`` command starts once per node, described by ``SKYPILOT_*`` variables.

SkyPilot sets, on every node of a task: ``SKYPILOT_NODE_IPS`` (the nodes' addresses, one per line, the head
first), ``SKYPILOT_NODE_RANK`` (this node's index), ``SKYPILOT_NUM_NODES`` and ``SKYPILOT_NUM_GPUS_PER_NODE``.

- ``towers launch`` on a SkyPilot node takes ``--nnodes``, ``--node-rank``, ``--master-addr`` (the head's address)
  and, on GPU nodes, ``--nproc-per-node`` from them (``launch_flags``); flags given on the command line win.
- A script started directly by the ``run`` command is one process per node: rank = node rank, world size = the
  node count, the rendezvous at the head's address and ``MASTER_PORT`` (default ``DEFAULT_PORT``, torchrun's).
"""

from __future__ import annotations

from typing import Mapping

from towers.cluster.base import ClusterConfigError, ClusterEnvironment, env_int, launch_options, role_of_rank
from towers.cluster.info import ProcessInfo
from towers.cluster.torchrun import read_master

__all__ = ["SkyPilotEnvironment", "skypilot_nodes", "launch_flags", "DEFAULT_PORT"]

#: The rendezvous port of a one-process-per-node SkyPilot job without ``MASTER_PORT`` (torchrun's default).
DEFAULT_PORT = 29500


def skypilot_nodes(environ: Mapping[str, str]) -> tuple[list[str], int, int]:
    """Return ``(node addresses, this node's rank, the node count)`` from SkyPilot's variables.

    Args:
        environ: the environment variables to read.

    Returns:
        The addresses of ``SKYPILOT_NODE_IPS`` (head first), ``SKYPILOT_NODE_RANK`` and ``SKYPILOT_NUM_NODES``
        (the number of addresses when unset).

    Raises:
        ClusterConfigError: a variable is malformed or they disagree; the message names them.
    """
    ips = [line.strip() for line in environ.get("SKYPILOT_NODE_IPS", "").replace(",", "\n").splitlines() if line.strip()]
    if not ips:
        raise ClusterConfigError("SKYPILOT_NODE_IPS must list the nodes' addresses, one per line. Received: "
                                 f"{environ.get('SKYPILOT_NODE_IPS', '')!r}. Run under `sky launch`, or unset the "
                                 "SKYPILOT_* variables.")
    num_nodes = env_int(environ, "SKYPILOT_NUM_NODES", len(ips), minimum=1)
    node_rank = env_int(environ, "SKYPILOT_NODE_RANK")
    if num_nodes != len(ips):
        raise ClusterConfigError(f"SKYPILOT_NUM_NODES={num_nodes} but SKYPILOT_NODE_IPS lists {len(ips)} address(es) "
                                 f"({', '.join(ips)}). Expected one address per node; fix the variables SkyPilot set.")
    if node_rank >= num_nodes:
        raise ClusterConfigError(f"SKYPILOT_NODE_RANK must be < SKYPILOT_NUM_NODES. Received: SKYPILOT_NODE_RANK="
                                 f"{node_rank}, SKYPILOT_NUM_NODES={num_nodes}. Number the nodes 0..{num_nodes - 1}.")
    return ips, node_rank, num_nodes


def launch_flags(environ: Mapping[str, str]) -> list[str]:
    """Return the ``towers launch`` flags SkyPilot's variables imply (none outside SkyPilot).

    Args:
        environ: the environment variables to read.

    Returns:
        ``["--nnodes", N, "--node-rank", R, "--master-addr", HEAD]`` plus ``["--nproc-per-node", G]`` when
        ``SKYPILOT_NUM_GPUS_PER_NODE`` is > 0; put before the command line's own flags, which win.

    Raises:
        ClusterConfigError: a variable is malformed; the message names it.
    """
    if not environ.get("SKYPILOT_NODE_IPS", "").strip():
        return []
    ips, node_rank, num_nodes = skypilot_nodes(environ)
    flags = ["--nnodes", str(num_nodes), "--node-rank", str(node_rank), "--master-addr", ips[0]]
    gpus = env_int(environ, "SKYPILOT_NUM_GPUS_PER_NODE", 0)
    if gpus > 0:
        flags += ["--nproc-per-node", str(gpus)]
    return flags


class SkyPilotEnvironment(ClusterEnvironment):
    """One process per SkyPilot node, described by ``SKYPILOT_NODE_IPS``/``_NODE_RANK``/``_NUM_NODES``."""

    name = "skypilot"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when SkyPilot's node list and node rank are set."""
        return bool(environ.get("SKYPILOT_NODE_IPS", "").strip()) and "SKYPILOT_NODE_RANK" in environ

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this node's one process; raises ``ClusterConfigError`` on bad values."""
        ips, node_rank, num_nodes = skypilot_nodes(environ)
        master_addr, master_port = read_master(environ, default_addr=ips[0], default_port=DEFAULT_PORT)
        strategy, num_ps = launch_options(environ)
        return ProcessInfo(rank=node_rank, world_size=num_nodes, local_rank=0, local_world_size=1,
                           node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                           task=role_of_rank(node_rank, num_nodes, num_ps), source=self.name, strategy=strategy,
                           num_ps=num_ps, chief_rank=0)
