"""Who am I in the job: ``from_env()`` reads this process's place from the environment.

Sources are detected in a fixed order: explicit arguments, ``TF_CONFIG``, a Ray Train worker, torchrun/Kubeflow
(``RANK``, ``WORLD_SIZE``, ...; Kubeflow Trainer v2's ``PET_*``), SLURM (``SLURM_PROCID``, ... under
``srun``; submitit's tasks as ``"submitit"``), MPI (``OMPI_COMM_WORLD_*``, ``PMI_*``), SkyPilot (``SKYPILOT_*``,
one process per node), else a single local process.
Only this package reads ``os.environ``; everything else receives the frozen ``ProcessInfo``.
"""

from towers.cluster.base import JOIN_TIMEOUT_VARIABLE, ClusterConfigError, ClusterEnvironment, read_join_timeout
from towers.cluster.detect import ENVIRONMENTS, describe, detect_environment, from_env
from towers.cluster.environ import environ_overrides, read_environ
from towers.cluster.info import DEFAULT_JOIN_TIMEOUT_S, TASK_TYPES, ClusterSpec, ProcessInfo, TaskInfo
from towers.cluster.kubeflow import KubeflowTrainerEnvironment
from towers.cluster.local import LocalEnvironment
from towers.cluster.mpi import MPIEnvironment
from towers.cluster.ray import RayTrainEnvironment
from towers.cluster.skypilot import SkyPilotEnvironment
from towers.cluster.slurm import SlurmEnvironment, expand_hostlist, is_srun_task, port_from_job_id
from towers.cluster.submitit import SubmititEnvironment, preemption_signal_names
from towers.cluster.tf_config import TRAINING_ORDER, TFConfigEnvironment, parse_tf_config
from towers.cluster.torchrun import TorchrunEnvironment

__all__ = [
    "from_env",
    "describe",
    "detect_environment",
    "ENVIRONMENTS",
    "ClusterEnvironment",
    "TFConfigEnvironment",
    "RayTrainEnvironment",
    "TorchrunEnvironment",
    "KubeflowTrainerEnvironment",
    "SlurmEnvironment",
    "SubmititEnvironment",
    "preemption_signal_names",
    "MPIEnvironment",
    "SkyPilotEnvironment",
    "LocalEnvironment",
    "ClusterConfigError",
    "ProcessInfo",
    "ClusterSpec",
    "TaskInfo",
    "TASK_TYPES",
    "TRAINING_ORDER",
    "parse_tf_config",
    "expand_hostlist",
    "port_from_job_id",
    "is_srun_task",
    "DEFAULT_JOIN_TIMEOUT_S",
    "JOIN_TIMEOUT_VARIABLE",
    "read_join_timeout",
    "read_environ",
    "environ_overrides",
]
