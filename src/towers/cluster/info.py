"""Frozen descriptions of a job's processes: ``ProcessInfo``, ``ClusterSpec``, ``TaskInfo``.

Everything outside ``towers.cluster`` receives one of these instead of reading ``os.environ``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from towers.errors import InvalidArgumentError

__all__ = ["TASK_TYPES", "DEFAULT_JOIN_TIMEOUT_S", "ClusterSpec", "TaskInfo", "ProcessInfo"]

#: Task types, as tf.distribute names them. ``chief`` is worker 0 when no chief is listed.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")

#: How long a process waits for the other processes of its job to join before it gives up (seconds):
#: ``towers launch --join-timeout`` / ``TOWERS_JOIN_TIMEOUT_S``.
DEFAULT_JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ClusterSpec:
    """Addresses (``host:port``) of every task, by task type.

    Attributes:
        jobs: task type (``chief``, ``worker``, ``ps``, ``evaluator``) -> the addresses of its tasks, in index
            order (TF_CONFIG's ``cluster``).

    Raises:
        ValueError: an unknown task type, or a job given as one string instead of a list.
    """

    jobs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for task_type, addresses in self.jobs.items():
            if task_type not in TASK_TYPES:
                raise InvalidArgumentError(
                    f"Unknown task type {task_type!r} in cluster spec. Expected one of {TASK_TYPES}. "
                    "Rename the job or remove it.")
            if isinstance(addresses, str):
                raise InvalidArgumentError(
                    f"Cluster job {task_type!r} must list addresses, received the string {addresses!r}. "
                    f"Write it as a list: [{addresses!r}].")
        frozen = {k: tuple(v) for k, v in self.jobs.items()}
        object.__setattr__(self, "jobs", MappingProxyType(frozen))

    def num_tasks(self, task_type: str) -> int:
        """Return how many tasks of ``task_type`` the cluster has (0 when none)."""
        return len(self.jobs.get(task_type, ()))

    def addresses(self, task_type: str) -> tuple[str, ...]:
        """Return the addresses of ``task_type``'s tasks, in index order."""
        return self.jobs.get(task_type, ())

    @property
    def num_workers(self) -> int:
        """Number of training processes: chief plus workers."""
        return self.num_tasks("chief") + self.num_tasks("worker")

    def as_dict(self) -> dict[str, list[str]]:
        """Return the spec as plain JSON-ready data, in TF_CONFIG's ``cluster`` form."""
        return {k: list(v) for k, v in self.jobs.items()}


@dataclass(frozen=True)
class TaskInfo:
    """This process's task: its type (``chief``/``worker``/``ps``/``evaluator``) and index.

    Attributes:
        type: ``"chief"``, ``"worker"``, ``"ps"`` or ``"evaluator"``.
        index: the task's index among its type's.

    Raises:
        ValueError: an unknown type or a negative index.
    """

    type: str = "worker"
    index: int = 0

    def __post_init__(self) -> None:
        if self.type not in TASK_TYPES:
            raise InvalidArgumentError(f"Unknown task type {self.type!r}. Expected one of {TASK_TYPES}.")
        if self.index < 0:
            raise InvalidArgumentError(f"Task index must be >= 0. Received: {self.index}.")


@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    """Who this process is in the job: ranks, sizes, role and where the rendezvous is.

    Attributes:
        rank: this process among every process of the job (ps tasks included).
        world_size: every process of the job.
        local_rank: this process among the processes on this host.
        local_world_size: the processes on this host.
        node_rank: this host among the job's hosts.
        master_addr: where the rendezvous is.
        master_port: its port (None: not known yet).
        task: this process's task type and index (TF_CONFIG's terms).
        cluster: every task's address, by type.
        source: where the values came from (``"tf_config"``, ``"torchrun"``, ``"slurm"``, ..., ``"single"``).
        strategy: what ``towers launch --strategy`` asked for (``TOWERS_STRATEGY``), or None.
        num_ps: what ``towers launch --num-ps`` asked for.
        chief_rank: the rank of the chief, the process that writes files and logs for the job.
        checkpoint_dir: where the job keeps checkpoints (``TOWERS_CHECKPOINT_DIR``, set by the manifests
            ``towers k8s`` renders), or None.
        restart_count: the launcher's restarts of this job.
        agent_store: True when the launcher's agent hosts the rendezvous store (torchrun), so no rank starts
            its own.
        interface: the network interface every link of the job binds (``TOWERS_INTERFACE``, set by ``towers
            launch --interface``, else ``GLOO_SOCKET_IFNAME``), or None: ``towers.network`` then picks one when
            the job spans hosts.
        log_level: the level of the rank-prefixed output ``towers launch`` sets up in its workers.
        join_timeout_s: the wait for the other processes at start-up (``TOWERS_JOIN_TIMEOUT_S``).
        stuck_timeout_s: the least time a rank may wait in one collective before the stuck-job watchdog ends
            the job (``TOWERS_STUCK_TIMEOUT_S``; None: its default, 0: no watchdog).
        strategy_options: options for the strategy from outside the script (``--strategy-option``).
        launch_dir: the directory ``towers launch`` made for this job, or None.
        verify_dir: where ``towers verify`` collects the parameters after each update, or None.
        verify_steps: how many updates ``towers verify`` compares.
        ledger_dir: where the ledger of trained examples is appended (``towers launch --ledger``), or None.
        replica_group: ``(group id, rank in the group, group size, the group store's port)`` under
            ``--strategy fault_tolerant``, or None.
        lighthouse: the torchft lighthouse's address, or None.
        preemption_signals: the signals that are preemption notices (e.g. ``"TERM,USR1"``), or None: the
            default.

    Raises:
        ValueError: a rank, size or port out of range.

    Example:
        ```python
        from towers.cluster import TorchrunEnvironment

        environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        info = TorchrunEnvironment().process_info(environ)
        assert info.rank == 1 and not info.is_chief
        ```
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    task: TaskInfo = field(default_factory=TaskInfo)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    source: str = "single"
    strategy: str | None = None
    num_ps: int = 0
    chief_rank: int = 0
    checkpoint_dir: str | None = None
    restart_count: int = 0
    agent_store: bool = False
    interface: str | None = None
    #: Level of the rank-prefixed log output ``towers launch`` sets up in its workers (``TOWERS_LOG_LEVEL``).
    log_level: str | None = None
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    stuck_timeout_s: float | None = None
    #: Options for the strategy from outside the script (``towers launch --strategy-option``, ``TOWERS_STRATEGY_OPTIONS``).
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    #: The directory ``towers launch`` made for this job, where a process leaves notes for it (``TOWERS_LAUNCH_DIR``:
    #: a strategy built), or None outside ``towers launch --strategy``.
    launch_dir: str | None = None
    #: Where ``towers verify`` collects the parameters after each update (``TOWERS_VERIFY_DIR``), or None: no capture.
    verify_dir: str | None = None
    #: How many updates ``towers verify`` compares (``TOWERS_VERIFY_STEPS``): the run ends cleanly after them.
    verify_steps: int = 0
    #: Where the Trainer (and ps task 0) append the ledger of what each committed update trained
    #: (``TOWERS_LEDGER_DIR``, set by ``towers launch --ledger``), or None: no ledger.
    ledger_dir: str | None = None
    #: This process's replica group as ``towers launch --strategy fault_tolerant`` set it (``TOWERS_FT_GROUP``,
    #: ``_GROUP_RANK``, ``_GROUP_SIZE``, ``_GROUP_PORT``): ``(group id, rank in the group, group size, the group store's
    #: port)``, or None.
    replica_group: tuple[int, int, int, int] | None = None
    #: The torchft lighthouse's address (``TORCHFT_LIGHTHOUSE``, set by ``towers launch --strategy fault_tolerant``).
    lighthouse: str | None = None
    #: The signals that are preemption notices (``TOWERS_PREEMPTION_SIGNALS``, e.g. ``"TERM,USR1"``), or None: the default.
    preemption_signals: str | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1. Received: {self.world_size}.")
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(
                f"rank must be in [0, world_size={self.world_size}). Received: rank={self.rank}. "
                "Check RANK/WORLD_SIZE (or TF_CONFIG's task index).")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise InvalidArgumentError(
                f"local_rank must be in [0, local_world_size={self.local_world_size}). "
                f"Received: local_rank={self.local_rank}.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise InvalidArgumentError(f"master_port must be in 1..65535. Received: {self.master_port}.")
        if self.restart_count < 0:
            raise InvalidArgumentError(f"restart_count must be >= 0. Received: {self.restart_count}.")
        if self.num_ps < 0:
            raise InvalidArgumentError(f"num_ps must be >= 0. Received: {self.num_ps}.")
        if self.verify_steps < 0:
            raise InvalidArgumentError(f"verify_steps must be >= 0. Received: {self.verify_steps}.")
        if not self.join_timeout_s > 0:
            raise InvalidArgumentError(f"join_timeout_s must be > 0 seconds. Received: {self.join_timeout_s}.")
        if self.stuck_timeout_s is not None and not 0 <= self.stuck_timeout_s < float("inf"):
            raise InvalidArgumentError(f"stuck_timeout_s must be None or a number of seconds >= 0 (0 turns the stuck-job "
                                       f"watchdog off). Received: {self.stuck_timeout_s}.")

    @property
    def is_chief(self) -> bool:
        """True for the one process that writes logs, checkpoints and plots (never an evaluator)."""
        return self.rank == self.chief_rank and not self.is_evaluator

    @property
    def is_evaluator(self) -> bool:
        """True for a TF_CONFIG ``evaluator`` task: a one-process world outside the training group."""
        return self.task.type == "evaluator"

    @property
    def is_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    def describe_rank(self, rank: int) -> str:
        """Return how a message names process ``rank`` of this job: its task and, when known, address and node.

        ``"rank 1 (worker:1 at host1:2222)"`` under TF_CONFIG; ``"rank 5 (node 1)"`` when the job
        spreads over nodes; ``"rank 3 (ps:0)"`` for a parameter server of ``towers launch --num-ps``.
        """
        ordered = [(t, i, a) for t in ("chief", "worker", "ps") for i, a in enumerate(self.cluster.addresses(t))]
        if len(ordered) == self.world_size and 0 <= rank < len(ordered):
            task_type, index, address = ordered[rank]
            return f"rank {rank} ({task_type}:{index} at {address})"
        details = []
        if self.num_ps and rank >= self.world_size - self.num_ps:
            details.append(f"ps:{rank - (self.world_size - self.num_ps)}")
        if self.world_size > self.local_world_size and self.world_size % self.local_world_size == 0:
            details.append(f"node {rank // self.local_world_size}")
        return f"rank {rank}" + (f" ({', '.join(details)})" if details else "")

    @property
    def init_method(self) -> str:
        """``tcp://addr:port`` of the rendezvous; raises when the port is unknown."""
        if self.master_port is None:
            raise InvalidArgumentError(
                "No rendezvous port is known for this process (MASTER_PORT is unset). "
                "Start the job with `towers launch` or torchrun, or pass master_port.")
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{self.master_port}"
