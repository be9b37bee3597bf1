"""``from_env``: find this process's place in the job from the first environment that applies."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from towers.cluster.base import (
    JOIN_TIMEOUT_VARIABLE,
    STUCK_TIMEOUT_VARIABLE,
    ClusterConfigError,
    ClusterEnvironment,
    env_int,
    read_join_timeout,
    read_stuck_timeout,
)
from towers.cluster.environ import read_environ
from towers.cluster.info import ProcessInfo
from towers.cluster.kubeflow import KubeflowTrainerEnvironment
from towers.cluster.launch_notes import LAUNCH_DIR_VARIABLE
from towers.cluster.local import LocalEnvironment
from towers.cluster.mpi import MPIEnvironment
from towers.cluster.ray import RayTrainEnvironment
from towers.cluster.skypilot import SkyPilotEnvironment
from towers.cluster.slurm import SlurmEnvironment
from towers.cluster.strategy_options import ENV as STRATEGY_OPTIONS_ENV
from towers.cluster.strategy_options import decode_strategy_options
from towers.cluster.submitit import SubmititEnvironment, preemption_signal_names
from towers.cluster.tf_config import TFConfigEnvironment
from towers.cluster.torchrun import TorchrunEnvironment
from towers.errors import InvalidTypeError

__all__ = ["ENVIRONMENTS", "VERIFY_DIR_VARIABLE", "VERIFY_STEPS_VARIABLE", "detect_environment", "from_env",
           "describe"]

#: Set by ``towers verify`` in the runs it starts: the capture directory and the number of updates to capture.
VERIFY_DIR_VARIABLE = "TOWERS_VERIFY_DIR"
#: Where the ledger of committed updates goes (``towers launch --ledger``).
LEDGER_DIR_VARIABLE = "TOWERS_LEDGER_DIR"
VERIFY_STEPS_VARIABLE = "TOWERS_VERIFY_STEPS"

#: Sources in priority order; the first whose ``detect`` is True describes the process.
#: Explicit keyword arguments to ``from_env`` override fields on top of it.
ENVIRONMENTS: tuple[ClusterEnvironment, ...] = (
    TFConfigEnvironment(),
    RayTrainEnvironment(),
    TorchrunEnvironment(),
    KubeflowTrainerEnvironment(),
    SubmititEnvironment(),
    SlurmEnvironment(),
    MPIEnvironment(),
    SkyPilotEnvironment(),
    LocalEnvironment(),
)

_FIELDS = tuple(f.name for f in dataclasses.fields(ProcessInfo))


def detect_environment(environ: Mapping[str, str],
                       environments: Sequence[ClusterEnvironment] = ENVIRONMENTS) -> ClusterEnvironment:
    """Return the first environment of ``environments`` that detects itself in ``environ``.

    Args:
        environ: the environment variables to look at.
        environments: the candidates, in order. Default: ``ENVIRONMENTS``.

    Returns:
        The first that detects itself; ``LocalEnvironment()`` when none does.
    """
    for environment in environments:
        if environment.detect(environ):
            return environment
    return LocalEnvironment()


def _check_no_conflict(info: ProcessInfo, environ: Mapping[str, str]) -> None:
    # TF_CONFIG describes one process per task. Under torchrun every local worker inherits the
    # same TF_CONFIG, so all of them would claim one task: refuse instead of hanging later.
    if info.source != TFConfigEnvironment.name or not TorchrunEnvironment().detect(environ):
        return
    rank, world = environ.get("RANK", "").strip(), environ.get("WORLD_SIZE", "").strip()
    if (rank, world) != (str(info.rank), str(info.world_size)):
        raise ClusterConfigError(
            f"TF_CONFIG and torchrun's variables disagree: TF_CONFIG makes this process rank {info.rank} of "
            f"{info.world_size} ({info.task.type}:{info.task.index}), but RANK={rank!r}, WORLD_SIZE={world!r}. "
            "TF_CONFIG describes one process per task; unset TF_CONFIG for processes started by "
            "torchrun/`towers launch`, or start one process per TF_CONFIG task.")


def from_env(environ: Mapping[str, str] | None = None, **explicit: Any) -> ProcessInfo:
    """Return this process's ``ProcessInfo``.

    Sources, in order: ``explicit`` keyword arguments (any ``ProcessInfo`` field, e.g. ``rank=1,
    world_size=2``: they replace the detected values); ``TF_CONFIG``; a Ray Train worker (torchrun's variables,
    which Ray sets, with ``RAY_JOB_ID``: ``source == "ray"``); torchrun/Kubeflow variables
    (``RANK``, ``WORLD_SIZE``, ...; Kubeflow Trainer v2's ``PET_*`` alone); SLURM (``SLURM_PROCID``, ...
    of an ``srun`` task; ``source == "submitit"`` when ``SUBMITIT_EXECUTOR=slurm`` says submitit started it);
    MPI (``OMPI_COMM_WORLD_*``, ``PMI_*``); SkyPilot's ``SKYPILOT_NODE_IPS``/``_NODE_RANK`` (one process per
    node); else one local process.
    ``TOWERS_STRATEGY``/``TOWERS_NUM_PS`` (set by ``towers launch``) fill ``strategy``/``num_ps``;
    ``TOWERS_CHECKPOINT_DIR`` (set by ``towers k8s`` manifests) fills ``checkpoint_dir``;
    ``TOWERS_JOIN_TIMEOUT_S`` (set by ``towers launch --join-timeout``) fills ``join_timeout_s``;
    ``TOWERS_STUCK_TIMEOUT_S`` fills ``stuck_timeout_s``;
    ``TOWERS_INTERFACE`` (set by ``towers launch --interface``), else ``GLOO_SOCKET_IFNAME``, fills ``interface``;
    ``TOWERS_LOG_LEVEL`` (set by ``towers launch``) fills ``log_level``;
    ``TOWERS_LAUNCH_DIR`` (set by ``towers launch --strategy``) fills ``launch_dir``;
    ``TOWERS_VERIFY_DIR``/``TOWERS_VERIFY_STEPS`` (set by ``towers verify``) fill ``verify_dir``/``verify_steps``;
    ``TOWERS_LEDGER_DIR`` (set by ``towers launch --ledger``) fills ``ledger_dir``; ``TOWERS_PREEMPTION_SIGNALS``
    (in a submitit job, by default: TERM, USR1 and submitit's signal) fills ``preemption_signals``;
    ``TOWERS_FT_GROUP*`` (set by ``towers launch --strategy fault_tolerant``) fill ``replica_group``
    and ``TORCHFT_LIGHTHOUSE`` ``lighthouse``.
    ``environ=None`` reads ``os.environ``; pass a dict in tests.

    Args:
        environ: the environment variables to read. None: ``os.environ``; pass a dict in tests.
        **explicit: ``ProcessInfo`` fields that replace the detected values (e.g. ``rank=1, world_size=2``).

    Returns:
        This process's place in the job, frozen.

    Raises:
        TypeError: on an unknown keyword.
        ClusterConfigError: (a ``ValueError``) when a variable is malformed; the message names it.
    """
    unknown = sorted(set(explicit) - set(_FIELDS))
    if unknown:
        raise InvalidTypeError(f"from_env() got unknown field(s) {unknown}. Expected ProcessInfo fields: {', '.join(_FIELDS)}.")
    environ = read_environ() if environ is None else environ
    info = detect_environment(environ).process_info(environ)
    _check_no_conflict(info, environ)
    checkpoint_dir = environ.get("TOWERS_CHECKPOINT_DIR", "").strip()
    if checkpoint_dir:
        info = dataclasses.replace(info, checkpoint_dir=checkpoint_dir)
    if environ.get(JOIN_TIMEOUT_VARIABLE, "").strip():
        info = dataclasses.replace(info, join_timeout_s=read_join_timeout(environ))
    if environ.get(STUCK_TIMEOUT_VARIABLE, "").strip():
        info = dataclasses.replace(info, stuck_timeout_s=read_stuck_timeout(environ))
    interface = environ.get("TOWERS_INTERFACE", "").strip() or environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if interface:
        info = dataclasses.replace(info, interface=interface)
    log_level = environ.get("TOWERS_LOG_LEVEL", "").strip().upper()
    if log_level:
        info = dataclasses.replace(info, log_level=log_level)
    launch_dir = environ.get(LAUNCH_DIR_VARIABLE, "").strip()
    if launch_dir:
        info = dataclasses.replace(info, launch_dir=launch_dir)
    if environ.get("TOWERS_FT_GROUP", "").strip():
        slot = tuple(env_int(environ, key, default) for key, default in (
            ("TOWERS_FT_GROUP", 0), ("TOWERS_FT_GROUP_RANK", 0), ("TOWERS_FT_GROUP_SIZE", 1), ("TOWERS_FT_GROUP_PORT", 0)))
        info = dataclasses.replace(info, replica_group=(slot[0], slot[1], slot[2], slot[3]))
    lighthouse = environ.get("TORCHFT_LIGHTHOUSE", "").strip()
    if lighthouse:
        info = dataclasses.replace(info, lighthouse=lighthouse)
    signals = preemption_signal_names(environ)
    if signals:
        info = dataclasses.replace(info, preemption_signals=signals)
    ledger_dir = environ.get(LEDGER_DIR_VARIABLE, "").strip()
    if ledger_dir:
        info = dataclasses.replace(info, ledger_dir=ledger_dir)
    verify_dir = environ.get(VERIFY_DIR_VARIABLE, "").strip()
    if verify_dir:
        info = dataclasses.replace(info, verify_dir=verify_dir,
                                   verify_steps=env_int(environ, VERIFY_STEPS_VARIABLE, 3, minimum=1))
    if environ.get(STRATEGY_OPTIONS_ENV, "").strip():
        try:
            options = decode_strategy_options(environ[STRATEGY_OPTIONS_ENV])
        except ValueError as exc:
            raise ClusterConfigError(str(exc)) from None
        info = dataclasses.replace(info, strategy_options=options)
    if explicit:
        explicit.setdefault("source", f"explicit+{info.source}")
        try:
            info = dataclasses.replace(info, **explicit)
        except ValueError as exc:
            raise ClusterConfigError(f"from_env() arguments {explicit} do not fit the {info.source} environment: {exc}") from None
    return info


def describe(info: ProcessInfo) -> str:
    """Return a one-line summary of ``info``, e.g. for a start-up log line.

    Args:
        info: a process's place in the job.

    Returns:
        E.g. ``"rank 1/2, local 1/2, node 0, task worker:1, not chief, master 127.0.0.1:29500, ..."``.
    """
    where = f"{info.master_addr}:{info.master_port}" if info.master_port is not None else f"{info.master_addr}:?"
    parts = [
        f"rank {info.rank}/{info.world_size}",
        f"local {info.local_rank}/{info.local_world_size}",
        f"node {info.node_rank}",
        f"task {info.task.type}:{info.task.index}",
        "chief" if info.is_chief else "not chief",
        f"master {where}",
        f"strategy {info.strategy or 'default'}",
    ]
    if info.num_ps:
        parts.append(f"num_ps {info.num_ps}")
    if info.preemption_signals:
        parts.append(f"preemption signals {info.preemption_signals}")
    parts.append(f"from {info.source}")
    return ", ".join(parts)
