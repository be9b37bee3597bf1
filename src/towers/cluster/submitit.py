"""submitit under SLURM: a SLURM job whose tasks submitit started, and the signal it sends before the time limit.

submitit's ``sbatch`` script exports ``SUBMITIT_EXECUTOR=slurm`` and runs the submitted function once per
``srun`` task, so each task carries SLURM's variables beside submitit's (``SUBMITIT_FOLDER``, ...). It asks
SLURM for ``--signal=USR2@90``: the tasks get SIGUSR2 (``SUBMITIT_PREEMPT_SIGNAL`` names another) some seconds
before the time limit or a preemption, so that the job can checkpoint and be requeued.

- ``from_env()`` reads such a task as SLURM does (one process per task), with ``source == "submitit"``.
- That signal is a preemption notice beside SIGTERM and SIGUSR1 (``preemption_signal_names``): every process
  saves at one agreed step, and the notice is then handed to submitit's own handler, which requeues the job
  (a ``submitit.helpers.Checkpointable`` function) the way submitit does. ``TOWERS_PREEMPTION_SIGNALS``, when
  set, still names the signals alone.
- ``towers launch`` in a one-task-per-node submitit job takes ``--nnodes``, ``--node-rank``, ``--master-addr``
  and ``--master-port`` from SLURM's variables (``launch_flags``); flags on the command line win.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from towers._logging import get_logger
from towers.cluster.base import ClusterConfigError, ClusterEnvironment, env_int
from towers.cluster.info import ProcessInfo
from towers.cluster.slurm import SlurmEnvironment, expand_hostlist, port_from_job_id
from towers.cluster.torchrun import read_master

__all__ = ["SubmititEnvironment", "is_submitit_job", "submitit_signal", "preemption_signal_names", "launch_flags",
           "SUBMITIT_DEFAULT_SIGNAL"]

#: The signal submitit asks SLURM to send before the time limit (``--signal=USR2@90``) when
#: ``SUBMITIT_PREEMPT_SIGNAL`` is unset.
SUBMITIT_DEFAULT_SIGNAL = "USR2"
log = get_logger(__name__)

_DEFAULT_NOTICES = ("TERM", "USR1")  # towers' own, as ``towers.checkpoint.preemption`` defaults to


def is_submitit_job(environ: Mapping[str, str]) -> bool:
    """Return True when ``environ`` is a task of a SLURM job that submitit submitted.

    Args:
        environ: the environment variables to look at.

    Returns:
        True when ``SUBMITIT_EXECUTOR`` is ``slurm`` and ``SLURM_JOB_ID`` is set.
    """
    return environ.get("SUBMITIT_EXECUTOR", "").strip() == "slurm" and bool(environ.get("SLURM_JOB_ID", "").strip())


def submitit_signal(environ: Mapping[str, str]) -> str | None:
    """Return the name of the signal submitit's job gets before its time limit (``"USR2"``), or None outside one.

    Args:
        environ: the environment variables to read.

    Returns:
        ``SUBMITIT_PREEMPT_SIGNAL`` (without a ``SIG`` prefix), else ``"USR2"``, in a submitit job; else None.
    """
    if not is_submitit_job(environ):
        return None
    name = environ.get("SUBMITIT_PREEMPT_SIGNAL", "").strip().upper() or SUBMITIT_DEFAULT_SIGNAL
    return name[3:] if name.startswith("SIG") else name


def preemption_signal_names(environ: Mapping[str, str]) -> str | None:
    """Return the signals that are preemption notices in this job, as ``TOWERS_PREEMPTION_SIGNALS`` names them.

    Args:
        environ: the environment variables to read.

    Returns:
        ``TOWERS_PREEMPTION_SIGNALS`` when set; in a submitit job, ``"TERM,USR1"`` plus submitit's signal; else
        None (``towers.checkpoint.preemption``'s default, SIGTERM and SIGUSR1).
    """
    named = environ.get("TOWERS_PREEMPTION_SIGNALS", "").strip()
    if named:
        return named
    extra = submitit_signal(environ)
    if extra is None:
        return None
    return ",".join(dict.fromkeys((*_DEFAULT_NOTICES, extra)))


def launch_flags(environ: Mapping[str, str]) -> list[str]:
    """Return the ``towers launch`` flags of a one-task-per-node submitit job (none elsewhere).

    Args:
        environ: the environment variables to read.

    Returns:
        ``["--nnodes", N, "--node-rank", R, "--master-addr", HEAD, "--master-port", PORT]``: the nodes of the
        job, this task's node, the job's first host and ``MASTER_PORT`` or ``15000 + SLURM_JOB_ID % 20000`` (as
        SLURM's tasks derive it). Empty outside submitit or with more than one task per node (those tasks are
        the training processes themselves: run the script directly, ``from_env()`` reads them).

    Raises:
        ClusterConfigError: a SLURM variable is malformed; the message names it.
    """
    if not is_submitit_job(environ) or not environ.get("SLURM_JOB_NODELIST", "").strip():
        return []
    nodes = env_int(environ, "SLURM_JOB_NUM_NODES", 1, minimum=1)
    if env_int(environ, "SLURM_NTASKS", nodes, minimum=1) != nodes:
        return []
    head = expand_hostlist(environ["SLURM_JOB_NODELIST"].strip())[0]
    addr, port = read_master(environ, head, port_from_job_id(env_int(environ, "SLURM_JOB_ID")))
    flags = ["--nnodes", str(nodes), "--node-rank", str(env_int(environ, "SLURM_NODEID", 0)), "--master-addr", addr,
             "--master-port", str(port)]
    log.info("a submitit job under SLURM (job %s, preemption notices %s): towers launch %s",
             environ["SLURM_JOB_ID"].strip(), preemption_signal_names(environ), " ".join(flags))
    return flags


class SubmititEnvironment(ClusterEnvironment):
    """A task of a submitit job under SLURM: read as SLURM's ``srun`` task, with ``source == "submitit"``."""

    name = "submitit"

    def __init__(self) -> None:
        self._slurm = SlurmEnvironment()

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True when SLURM describes this process and ``SUBMITIT_EXECUTOR=slurm`` says submitit started it."""
        return is_submitit_job(environ) and self._slurm.detect(environ)

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return this task's ``ProcessInfo``; raises ``ClusterConfigError`` on bad values (naming submitit's fix)."""
        try:
            info = self._slurm.process_info(environ)
        except ClusterConfigError as exc:
            raise ClusterConfigError(f"{exc} (submitit: set tasks_per_node to the processes per node in "
                                     "executor.update_parameters, so that srun starts every task)") from None
        return dataclasses.replace(info, source=self.name, preemption_signals=preemption_signal_names(environ))
