"""SLURM: one process per ``srun`` task, described by ``SLURM_*`` variables.

``rank`` = ``SLURM_PROCID``, ``world_size`` = ``SLURM_NTASKS``, ``local_rank`` = ``SLURM_LOCALID``,
``node_rank`` = ``SLURM_NODEID``; ``local_world_size`` comes from ``SLURM_NTASKS_PER_NODE`` or,
failing that, this node's entry of ``SLURM_TASKS_PER_NODE`` (``"4(x2),2"``).

The rendezvous host is ``MASTER_ADDR`` when set, else the first host of ``SLURM_JOB_NODELIST``.
The port is ``MASTER_PORT`` when set, else ``15000 + SLURM_JOB_ID % 20000`` (15000..34999): every
task of a job derives the same port without talking to the others, and two jobs sharing a head
node rarely collide. ``towers k8s --kind slurm`` uses the same formula.

Only an ``srun`` task (``SLURM_STEP_ID`` set) is a process of a multi-process job. A batch script or
an ``salloc`` shell also carries ``SLURM_PROCID=0`` and the allocation's ``SLURM_NTASKS``, but
nothing starts the other tasks there: with more than one task that is refused with one line
(run under ``srun`` or ``towers launch``), instead of waiting for peers that never come. When MPI's
variables describe the process and this is not an ``srun`` task (``mpirun`` inside an allocation),
SLURM steps aside and the MPI source reads it.
"""

from __future__ import annotations

import re
from typing import Mapping

from towers.cluster.base import ClusterConfigError, ClusterEnvironment, env_int, launch_options, role_of_rank
from towers.cluster.info import ProcessInfo
from towers.cluster.torchrun import read_master
from towers.errors import InvalidArgumentError

__all__ = ["SlurmEnvironment", "expand_hostlist", "port_from_job_id", "is_srun_task", "SLURM_PORT_BASE",
           "SLURM_PORT_SPAN"]

SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000


def port_from_job_id(job_id: int) -> int:
    """Return the rendezvous port every task of SLURM job ``job_id`` derives (15000..34999).

    Args:
        job_id: ``SLURM_JOB_ID``.

    Returns:
        ``15000 + job_id % 20000``: the same on every task, without a message between them.
    """
    return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN


def is_srun_task(environ: Mapping[str, str]) -> bool:
    """Return True when ``environ`` is an ``srun`` task's (a job step), not a batch or ``salloc`` shell's.

    Args:
        environ: the environment variables to look at.

    Returns:
        True when ``SLURM_STEP_ID`` (or ``SLURM_STEPID``) is set.
    """
    return any(environ.get(name, "").strip() for name in ("SLURM_STEP_ID", "SLURM_STEPID"))


def _split_top_level(text: str) -> list[str]:
    # Split on commas that are not inside [...].
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_one(pattern: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    names: list[str] = []
    for item in match.group(1).split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise InvalidArgumentError(f"bad range {item!r} in {pattern!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            names.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
    return names


def expand_hostlist(hostlist: str) -> list[str]:
    """Return the host names of a SLURM host list such as ``"gpu[01-03,07],login1"``.

    Args:
        hostlist: ``SLURM_JOB_NODELIST``'s compressed form.

    Returns:
        The host names in order, e.g. ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``.

    Raises:
        ClusterConfigError: when the list is malformed.
    """
    try:
        hosts = [h for part in _split_top_level(hostlist) for h in _expand_one(part)]
    except ValueError as exc:
        raise ClusterConfigError(
            f"SLURM_JOB_NODELIST is not a SLURM host list ({exc}). Received: {hostlist!r}. "
            "Expected e.g. 'node[01-04],login1'; or set MASTER_ADDR to the first node's address.") from None
    if not hosts:
        raise ClusterConfigError(f"SLURM_JOB_NODELIST lists no host. Received: {hostlist!r}. "
                                 "Set MASTER_ADDR to the first node's address.")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),2": 4 tasks on each of 2 nodes, then 2 on the next one.
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ClusterConfigError(
                f"SLURM_TASKS_PER_NODE is malformed. Received: {tasks_per_node!r}. Expected e.g. '4(x2),2'; "
                "or set SLURM_NTASKS_PER_NODE.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if node_id >= len(counts):
        raise ClusterConfigError(
            f"SLURM_NODEID={node_id} has no entry in SLURM_TASKS_PER_NODE={tasks_per_node!r}. "
            "Run the job through srun so SLURM sets consistent variables.")
    return counts[node_id]


class SlurmEnvironment(ClusterEnvironment):
    """Reads ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ... (one process per srun task)."""

    name = "slurm"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when ``SLURM_PROCID`` and ``SLURM_NTASKS`` are set (and MPI does not describe a non-srun process)."""
        if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
            return False
        from towers.cluster.mpi import MPIEnvironment  # the two sources know about each other only here

        return is_srun_task(environ) or not MPIEnvironment().detect(environ)

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this task's ``ProcessInfo``; raises ``ClusterConfigError`` on bad values or outside ``srun``."""
        if not is_srun_task(environ):
            return self._allocation_shell(environ)
        count_variable = "SLURM_STEP_NUM_TASKS" if environ.get("SLURM_STEP_NUM_TASKS", "").strip() else "SLURM_NTASKS"
        world_size = env_int(environ, count_variable, minimum=1)
        rank = env_int(environ, "SLURM_PROCID")
        if rank >= world_size:
            raise ClusterConfigError(
                f"SLURM_PROCID must be < {count_variable}. Received: SLURM_PROCID={rank}, {count_variable}={world_size}. "
                "Start the processes with srun so SLURM sets both.")
        local_rank = env_int(environ, "SLURM_LOCALID", 0)
        node_rank = env_int(environ, "SLURM_NODEID", 0)
        if environ.get("SLURM_NTASKS_PER_NODE", "").strip():
            local_world_size = env_int(environ, "SLURM_NTASKS_PER_NODE", minimum=1)
        elif environ.get("SLURM_STEP_TASKS_PER_NODE", "").strip():
            local_world_size = _tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], node_rank)
        elif environ.get("SLURM_TASKS_PER_NODE", "").strip():
            local_world_size = _tasks_on_node(environ["SLURM_TASKS_PER_NODE"], node_rank)
        else:
            local_world_size = local_rank + 1
        if local_rank >= local_world_size:
            raise ClusterConfigError(
                f"SLURM_LOCALID must be < the tasks on this node. Received: SLURM_LOCALID={local_rank}, "
                f"tasks per node={local_world_size}. Start the processes with srun so SLURM sets consistent values.")
        nodelist = environ.get("SLURM_JOB_NODELIST", "").strip() or environ.get("SLURM_NODELIST", "").strip()
        default_addr = expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1"
        default_port = None
        if environ.get("SLURM_JOB_ID", "").strip():
            default_port = port_from_job_id(env_int(environ, "SLURM_JOB_ID"))
        master_addr, master_port = read_master(environ, default_addr, default_port)
        strategy, num_ps = launch_options(environ)
        return ProcessInfo(rank=rank, world_size=world_size, local_rank=local_rank,
                           local_world_size=local_world_size, node_rank=node_rank, master_addr=master_addr,
                           master_port=master_port, task=role_of_rank(rank, world_size, num_ps),
                           source=self.name, strategy=strategy, num_ps=num_ps, chief_rank=0)

    def _allocation_shell(self, environ: Mapping[str, str]) -> ProcessInfo:
        # A batch script or salloc shell: SLURM_PROCID=0 of the allocation's tasks, but no srun started them.
        tasks = env_int(environ, "SLURM_NTASKS", minimum=1)
        if tasks > 1:
            job = environ.get("SLURM_JOB_ID", "").strip() or "?"
            raise ClusterConfigError(
                f"This process runs in a SLURM allocation shell (SLURM_JOB_ID={job}, SLURM_NTASKS={tasks}), not as an "
                f"srun task (SLURM_STEP_ID is unset), so the other {tasks - 1} task(s) would never start. Run it as "
                f"`srun python SCRIPT` (one process per task) or `towers launch --nproc-per-node N SCRIPT`.")
        master_addr, master_port = read_master(environ)
        strategy, num_ps = launch_options(environ)
        return ProcessInfo(master_addr=master_addr, master_port=master_port, source=self.name, strategy=strategy,
                           num_ps=num_ps)
