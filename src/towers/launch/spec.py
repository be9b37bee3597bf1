"""``LaunchSpec``: what ``towers launch`` was asked to run, validated once, frozen.

The flags are torchrun's own plus towers' (``flags.py``: ``launch_parser``); ``spec_from_args`` and
``parse_launch_args`` turn them into a ``LaunchSpec``. This module imports torch only inside
``launch_parser``/``parse_launch_args``.
"""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from towers.cluster import roles as _roles
from towers.cluster.environ import read_environ
from towers.cluster.skypilot import launch_flags as skypilot_launch_flags
from towers.cluster.strategy_options import ENV as STRATEGY_OPTIONS_ENV
from towers.cluster.strategy_options import encode_strategy_options, parse_strategy_options
from towers.cluster.submitit import launch_flags as submitit_launch_flags
from towers.errors import InvalidArgumentError
from towers.launch.flags import (
    DEFAULT_GROUP_RESTARTS,
    DEFAULT_MONITOR_INTERVAL_S,
    SPEC_OPTIONS,
    STRATEGY_ALIASES,
    STRATEGY_NAMES,
    canonical_strategy,
    launch_parser,
    parse_nnodes,
    resolve_nproc_per_node,
    usable_cores,
    with_bitwise,
    with_mesh,
)
from towers.launch.spawn import cpu_threads_per_process

__all__ = [
    "STRATEGY_NAMES",
    "STRATEGY_ALIASES",
    "DEFAULT_MONITOR_INTERVAL_S",
    "DEFAULT_GROUP_RESTARTS",
    "LaunchSpec",
    "canonical_strategy",
    "resolve_nproc_per_node",
    "parse_nnodes",
    "launch_parser",
    "with_mesh",
    "spec_from_args",
    "parse_launch_args",
]


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """A validated ``towers launch`` request: what to run, on how many processes, with which strategy.

    ``master_port=None`` means "pick one": a free loopback port on a single node, torchrun's 29500
    across nodes. ``num_ps=None`` means "not given": 1 under ``strategy="ps"``, else 0; a positive
    ``num_ps`` without a strategy implies ``"ps"``. ``tolerate_worker_failures=None`` means "not
    given": True under ``strategy="ps"`` (a non-chief worker that fails does not stop the job; see
    ``towers.launch.supervise``), else False. ``group_restarts=None`` means "not given":
    ``DEFAULT_GROUP_RESTARTS`` under a strategy that restarts a lost replica alone (``"fault_tolerant"``),
    else 0. ``torchrun_options`` carries every other torchrun flag unchanged (``log_dir``,
    ``redirects``, ``start_method``, ...).
    """

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    max_restarts: int = 0
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S
    strategy: str | None = None
    num_ps: int | None = None
    tolerate_worker_failures: bool | None = None
    group_restarts: int | None = None
    group_size: int = 1
    interface: str | None = None
    join_timeout_s: float | None = None
    #: Where every process appends the ledger of committed updates (``--ledger``; ``TOWERS_LEDGER_DIR``).
    ledger_dir: str | None = None
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    torchrun_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        if not isinstance(self.script, str) or not self.script.strip():
            raise InvalidArgumentError("towers launch needs a script to run. Received: nothing. "
                                       "Usage: towers launch --nproc-per-node 2 train.py [args ...]")
        set_("script_args", tuple(str(a) for a in self.script_args))
        set_("torchrun_options", MappingProxyType(dict(self.torchrun_options)))
        set_("strategy_options", MappingProxyType(dict(self.strategy_options)))
        if self.module and self.no_python:
            raise InvalidArgumentError("--module and --no-python exclude each other: a module needs Python. Drop one of them.")
        if self.module and self.run_path:
            raise InvalidArgumentError("--module and --run-path exclude each other. Drop one of them.")
        for name, value, low in (("nproc_per_node", self.nproc_per_node, 1), ("min_nodes", self.min_nodes, 1),
                                 ("node_rank", self.node_rank, 0), ("max_restarts", self.max_restarts, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgumentError(f"{name} must be an integer >= {low}. Received: {value!r}. "
                                           f"Fix --{name.replace('_', '-')}.")
        if not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes:
            raise InvalidArgumentError(f"max_nodes must be >= min_nodes={self.min_nodes}. Received: {self.max_nodes!r}. "
                                       "Use --nnodes N or --nnodes MIN:MAX.")
        if self.rdzv_backend == "static" and self.node_rank >= self.max_nodes:
            raise InvalidArgumentError(f"--node-rank must be < --nnodes ({self.max_nodes}). Received: {self.node_rank}. "
                                       "Number the nodes 0..nnodes-1.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise InvalidArgumentError(f"--master-port must be in 1..65535. Received: {self.master_port}. "
                                       "Omit it on one node to get a free port.")
        if not self.master_addr:
            raise InvalidArgumentError("--master-addr must not be empty. Use the chief node's host name or IP "
                                       "(127.0.0.1 on one node).")
        if not self.rdzv_backend:
            raise InvalidArgumentError("--rdzv-backend must not be empty. Use 'static' (default) or 'c10d'.")
        if not self.monitor_interval_s > 0:
            raise InvalidArgumentError(f"--monitor-interval must be > 0 seconds. Received: {self.monitor_interval_s}. "
                                       f"Example: --monitor-interval {DEFAULT_MONITOR_INTERVAL_S}.")
        if self.interface is not None and (not self.interface.strip() or any(c.isspace() for c in self.interface)):
            raise InvalidArgumentError(f"--interface must name one network interface of this host, e.g. --interface eth0. "
                                       f"Received: {self.interface!r}. `towers doctor` lists this host's interfaces.")
        if self.join_timeout_s is not None and not 0 < self.join_timeout_s < float("inf"):
            raise InvalidArgumentError(f"--join-timeout must be a number of seconds > 0. Received: {self.join_timeout_s}. "
                                       "Example: --join-timeout 600, or omit it for the default (TOWERS_JOIN_TIMEOUT_S, else "
                                       "300 s).")
        self._resolve_strategy(set_)

    def _resolve_strategy(self, set_: Any) -> None:
        strategy = canonical_strategy(self.strategy) if self.strategy is not None else None
        num_ps = self.num_ps
        if num_ps is not None and (isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0):
            raise InvalidArgumentError(f"--num-ps must be an integer >= 0. Received: {num_ps!r}. Example: --num-ps 1.")
        if strategy is None and num_ps:
            strategy = "ps"
        entry = _roles.strategy_entry(strategy) if strategy is not None else None
        if entry is not None and entry.has_ps:
            num_ps = 1 if num_ps is None else num_ps
            if num_ps < 1:
                raise InvalidArgumentError(f"--strategy {strategy} needs at least one parameter server. Received: --num-ps 0. "
                                           "Use --num-ps 1 (or more).")
        elif num_ps:
            raise InvalidArgumentError(f"--num-ps only applies to strategies with parameter servers. Received: --strategy "
                                       f"{strategy} --num-ps {num_ps}. Drop --num-ps or use --strategy ps.")
        num_ps = num_ps or 0
        _roles.check_num_ps(num_ps, self.min_world_size, source="--num-ps",
                            hint=f"towers launch --num-ps {num_ps} --nproc-per-node {num_ps + 1} ...")
        if entry is not None and not entry.multi_process and self.max_world_size > 1:
            raise InvalidArgumentError(
                f"--strategy one_device trains one replica, but the job starts {self.max_world_size} processes. "
                "Use --nproc-per-node 1 --nnodes 1, or --strategy mirrored / multi_worker_mirrored.")
        tolerate = self.tolerate_worker_failures
        if tolerate is not None and not isinstance(tolerate, bool):
            raise InvalidArgumentError(f"tolerate_worker_failures must be True, False or None. Received: {tolerate!r}.")
        survives = bool(entry is not None and entry.survives_dead_worker)
        if tolerate and not survives:
            raise InvalidArgumentError(
                f"--tolerate-worker-failures only applies to --strategy ps (parameter servers go on without a "
                f"dead worker; every other strategy needs all of them). Received: --strategy {strategy}. Drop the "
                "flag or use --strategy ps.")
        if self.strategy_options and strategy is None:
            raise InvalidArgumentError(f"--strategy-option needs --strategy: the options belong to one strategy. Received: "
                                       f"{dict(self.strategy_options)} without --strategy. Add e.g. --strategy ps.")
        mesh = self.strategy_options.get("mesh")
        if mesh is not None and self.min_nodes == self.max_nodes:
            from towers.cluster.mesh import parse_mesh

            spec = parse_mesh(str(mesh))
            if spec is not None:
                spec.resolved(self.nproc_per_node * self.max_nodes)  # dp x tp must be the job's processes
        restarts = self.group_restarts
        alone = bool(entry is not None and entry.restarts_lost_replica)
        if restarts is not None and (isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0):
            raise InvalidArgumentError(f"--group-restarts must be an integer >= 0. Received: {restarts!r}. "
                                       f"Example: --group-restarts {DEFAULT_GROUP_RESTARTS}.")
        if restarts and not alone:  # 0 is what every other strategy resolves to (dataclasses.replace passes it on)
            raise InvalidArgumentError(
                f"--group-restarts only applies to --strategy fault_tolerant (a lost replica group is restarted alone "
                f"while the others train on; every other strategy needs all of its processes). Received: --strategy "
                f"{strategy} --group-restarts {restarts}. Drop the flag, or use --max-restarts to restart the whole "
                "job.")
        set_("strategy", strategy)
        set_("num_ps", num_ps)
        set_("tolerate_worker_failures", survives if tolerate is None else tolerate)
        set_("group_restarts", (DEFAULT_GROUP_RESTARTS if restarts is None else restarts) if alone else 0)
        size = self.group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgumentError(f"--group-size must be an integer >= 1. Received: {size!r}. Example: --group-size 2.")
        if size > 1 and not alone:
            raise InvalidArgumentError("--group-size only applies to --strategy fault_tolerant (processes per replica "
                                       f"group). Received: --strategy {strategy} --group-size {size}. Drop the flag or use "
                                       "--strategy ft.")
        if self.nproc_per_node % size:
            raise InvalidArgumentError("--nproc-per-node must be a multiple of --group-size: a replica group's processes "
                                       f"run on one node. Received: --nproc-per-node {self.nproc_per_node} --group-size "
                                       f"{size}. Use e.g. --nproc-per-node {size * max(1, self.nproc_per_node // size)}.")
        if self.ledger_dir is not None and os.path.exists(self.ledger_dir) and not os.path.isdir(self.ledger_dir):
            raise InvalidArgumentError(f"--ledger must be a directory (every process writes its ledger file under "
                                       f"DIR/ledger). Received: --ledger {self.ledger_dir}, a file. Pass a new or existing "
                                       "directory, e.g. --ledger runs/job1.")

    @property
    def restarts_lost_replica(self) -> bool:
        """True under a strategy whose lost replica group is restarted alone (a lighthouse on node 0, a supervisor each)."""
        return self.strategy is not None and _roles.strategy_entry(self.strategy).restarts_lost_replica

    @property
    def min_world_size(self) -> int:
        """Processes in the job when the fewest nodes join."""
        return self.min_nodes * self.nproc_per_node

    @property
    def max_world_size(self) -> int:
        """Processes in the job when the most nodes join."""
        return self.max_nodes * self.nproc_per_node

    @property
    def is_single_node(self) -> bool:
        """True when the job runs on this host only."""
        return self.max_nodes == 1

    def command(self, python: str = "python") -> list[str]:
        """Return the command line each worker runs (for logs and error messages)."""
        if self.run_path or not self.no_python:
            head = [python, "-u", *(["-m"] if self.module else []), self.script]
        else:
            head = [self.script]
        return [*head, *self.script_args]

    def worker_environment(self, environ: Mapping[str, str], *, cores: int | None = None) -> dict[str, str]:
        """Return the variables ``towers launch`` adds to every worker's environment (on top of torchrun's).

        ``TOWERS_STRATEGY``/``TOWERS_NUM_PS`` when a strategy was asked for; ``GLOO_SOCKET_IFNAME``,
        ``NCCL_SOCKET_IFNAME`` and ``TOWERS_INTERFACE`` under ``--interface``; ``TOWERS_JOIN_TIMEOUT_S``
        under ``--join-timeout``; ``RUST_LOG=warn`` under ``--strategy fault_tolerant`` unless set; ``OMP_NUM_THREADS`` =
        max(1, cores // nproc_per_node) unless ``environ`` already sets it.
        """
        updates: dict[str, str] = {}
        if self.interface is not None:  # one interface for every link: Gloo, NCCL and towers' own
            from towers.network import find_interface

            # on this host; raises NetworkError (a ValueError) listing the choices
            if find_interface(self.interface).is_loopback and not self.is_single_node:
                raise InvalidArgumentError(f"--interface {self.interface} is loopback, but the job spans {self.max_nodes} "
                                           "nodes that cannot reach it. Name the interface that reaches the other nodes, "
                                           "or leave --interface out to have it detected.")
            updates.update(GLOO_SOCKET_IFNAME=self.interface, NCCL_SOCKET_IFNAME=self.interface,
                           TOWERS_INTERFACE=self.interface)
        if self.join_timeout_s is not None:
            updates["TOWERS_JOIN_TIMEOUT_S"] = f"{self.join_timeout_s:g}"
        if self.ledger_dir is not None:
            updates["TOWERS_LEDGER_DIR"] = os.path.abspath(self.ledger_dir)
        if self.strategy is not None:
            updates["TOWERS_STRATEGY"] = self.strategy
            updates["TOWERS_NUM_PS"] = str(self.num_ps)
        if self.strategy_options:
            updates[STRATEGY_OPTIONS_ENV] = encode_strategy_options(self.strategy_options)
        if self.restarts_lost_replica and not environ.get("RUST_LOG", "").strip():
            updates["RUST_LOG"] = "warn"  # torchft's Rust side logs every quorum (every step) at INFO
        if not environ.get("TOWERS_LOG_LEVEL", "").strip():  # towers' own lines, [rank r/w]-prefixed, in the workers
            updates["TOWERS_LOG_LEVEL"] = "INFO"
        if not environ.get("OMP_NUM_THREADS", "").strip():
            updates["OMP_NUM_THREADS"] = str(cpu_threads_per_process(self.nproc_per_node, cores))
        return updates


def spec_from_args(args: argparse.Namespace, *, gpu_count: int | None = None,
                   cpu_count: int | None = None) -> LaunchSpec:
    """Return the ``LaunchSpec`` for parsed ``launch_parser()`` flags.

    ``gpu_count``/``cpu_count`` resolve ``--nproc-per-node auto|gpu|cpu`` (default: this host's).

    Raises:
        ValueError: on any invalid flag; the message names it and the fix.
    """
    if gpu_count is None:
        text = str(args.nproc_per_node).strip().lower()
        gpu_count = 0
        if text in ("auto", "gpu"):
            from towers.devices import gpu_count as visible_gpus

            gpu_count = visible_gpus()
    cpu_count = usable_cores() if cpu_count is None else cpu_count
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    rdzv_backend, rdzv_endpoint, rdzv_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    if getattr(args, "standalone", False):  # as torchrun does: a c10d store on a free local port
        rdzv_backend, rdzv_endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    passthrough = {k: v for k, v in vars(args).items() if k not in SPEC_OPTIONS}
    return LaunchSpec(
        script=args.training_script,
        script_args=tuple(args.training_script_args),
        module=bool(args.module),
        no_python=bool(args.no_python),
        run_path=bool(getattr(args, "run_path", False)),
        nproc_per_node=resolve_nproc_per_node(args.nproc_per_node, gpu_count=gpu_count, cpu_count=cpu_count),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        max_restarts=args.max_restarts,
        monitor_interval_s=float(args.monitor_interval),
        strategy=args.strategy,
        num_ps=args.num_ps,
        strategy_options=with_bitwise(with_mesh(parse_strategy_options(getattr(args, "strategy_option", None) or []),
                                                getattr(args, "mesh", None)), bool(getattr(args, "bitwise", False))),
        tolerate_worker_failures=getattr(args, "tolerate_worker_failures", None),
        group_restarts=getattr(args, "group_restarts", None),
        group_size=getattr(args, "group_size", 1),
        interface=getattr(args, "interface", None),
        join_timeout_s=getattr(args, "join_timeout", None),
        ledger_dir=getattr(args, "ledger", None),
        torchrun_options=passthrough,
    )


def parse_launch_args(argv: Sequence[str], *, gpu_count: int | None = None,
                      cpu_count: int | None = None, environ: Mapping[str, str] | None = None) -> LaunchSpec:
    """Return the ``LaunchSpec`` for a ``towers launch`` command line (without the ``towers launch`` words).

    On a SkyPilot node (``SKYPILOT_NODE_IPS``, ... in ``environ``, default this process's) they give the defaults of
    ``--nnodes``, ``--node-rank``, ``--master-addr`` and, on GPU nodes, ``--nproc-per-node``; in a one-task-per-node
    submitit job under SLURM, SLURM's variables give ``--nnodes``, ``--node-rank``, ``--master-addr`` and
    ``--master-port``.

    Raises:
        SystemExit: on ``--help`` or a flag argparse rejects (it prints the usage).
        ValueError: on an invalid combination of flags, or malformed ``SKYPILOT_*`` or ``SLURM_*`` variables.
    """
    # On a SkyPilot node its variables give --nnodes, --node-rank, --master-addr (and --nproc-per-node on GPU
    # nodes); put first, so the command line's own flags win.
    environ = read_environ() if environ is None else environ
    args = launch_parser().parse_args([*skypilot_launch_flags(environ), *submitit_launch_flags(environ), *argv])
    return spec_from_args(args, gpu_count=gpu_count, cpu_count=cpu_count)
