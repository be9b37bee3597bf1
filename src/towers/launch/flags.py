"""``towers launch``'s flags: torchrun's own parser plus towers' additions, and the values they take.

The flags are torchrun's own (``torch.distributed.run``'s parser is reused, so every torchrun flag
works and ``PET_*`` variables fill defaults as under torchrun) plus ``--strategy``, ``--num-ps`` and
``--[no-]tolerate-worker-failures``. This module imports torch only inside ``launch_parser``.
``towers.launch.spec`` builds the ``LaunchSpec`` from them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from towers.cluster import roles as _roles
from towers.errors import InvalidArgumentError

__all__ = [
    "STRATEGY_NAMES",
    "STRATEGY_ALIASES",
    "DEFAULT_MONITOR_INTERVAL_S",
    "DEFAULT_GROUP_RESTARTS",
    "canonical_strategy",
    "resolve_nproc_per_node",
    "parse_nnodes",
    "launch_parser",
    "with_mesh",
    "with_bitwise",
]

#: Strategy names ``towers launch --strategy`` accepts, as the workers see them in ``TOWERS_STRATEGY``
#: (the one table, ``towers.cluster.roles.STRATEGIES``).
STRATEGY_NAMES = tuple(_roles.strategy_names())
#: Other spellings, mapped to the names above (matching is case-insensitive, ``-`` == ``_``).
STRATEGY_ALIASES = {alias: entry.name for entry in _roles.STRATEGIES for alias in entry.aliases}
#: How often the launcher checks its workers (seconds); a failed worker is noticed this fast.
DEFAULT_MONITOR_INTERVAL_S = 0.5
#: Under a strategy that restarts a lost replica alone (``--strategy ft``): restarts per process when
#: ``--group-restarts`` is not given.
DEFAULT_GROUP_RESTARTS = 3

# torchrun options that LaunchSpec holds as fields; every other torchrun option is passed through.
SPEC_OPTIONS = frozenset({
    "training_script", "training_script_args", "module", "no_python", "run_path", "nproc_per_node", "nnodes",
    "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "standalone",
    "max_restarts", "monitor_interval", "strategy", "num_ps", "tolerate_worker_failures", "interface",
    "join_timeout", "strategy_option", "group_restarts", "group_size", "ledger", "mesh", "bitwise",
})


def canonical_strategy(name: str) -> str:
    """Return the canonical strategy name for ``name`` (``"parameter_server"`` -> ``"ps"``).

    Raises:
        ValueError: when ``name`` is not a known strategy; the message lists the choices.
    """
    key = str(name).strip().lower().replace("-", "_")
    key = STRATEGY_ALIASES.get(key, key)
    if key not in STRATEGY_NAMES:
        raise InvalidArgumentError(
            f"Unknown strategy: --strategy must be one of {', '.join(STRATEGY_NAMES)} "
            f"(aliases: {', '.join(sorted(STRATEGY_ALIASES))}). Received: {name!r}. Pick one of those names.")
    return key


def resolve_nproc_per_node(value: str | int, *, gpu_count: int, cpu_count: int) -> int:
    """Return the number of processes per node for torchrun's ``--nproc-per-node`` value.

    Like torchrun: an integer; ``gpu`` = the visible CUDA devices; ``cpu`` = the usable cores;
    ``auto`` = the GPUs when there are any, else the cores.

    Raises:
        ValueError: on anything else, on ``gpu`` without a GPU, or on a count below 1.
    """
    text = str(value).strip().lower()
    if text.lstrip("-").isdigit():
        count = int(text)
    elif text == "gpu":
        if gpu_count < 1:
            raise InvalidArgumentError("--nproc-per-node gpu needs a CUDA GPU, and none is visible. "
                                       "Use --nproc-per-node cpu (or a number) on a CPU host.")
        count = gpu_count
    elif text == "cpu":
        count = cpu_count
    elif text == "auto":
        count = gpu_count if gpu_count > 0 else cpu_count
    else:
        raise InvalidArgumentError(f"--nproc-per-node must be a positive integer, 'auto', 'gpu' or 'cpu'. "
                                   f"Received: {value!r}. Example: --nproc-per-node 2.")
    if count < 1:
        raise InvalidArgumentError(f"--nproc-per-node must be >= 1. Received: {value!r}. Example: --nproc-per-node 2.")
    return count


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """Return ``(min_nodes, max_nodes)`` for torchrun's ``--nnodes N`` or ``--nnodes MIN:MAX``.

    Raises:
        ValueError: when the value is not ``N`` or ``MIN:MAX`` with ``1 <= MIN <= MAX``.
    """
    parts = str(value).strip().split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise InvalidArgumentError(f"--nnodes must be N or MIN:MAX. Received: {value!r}. "
                                   "Example: --nnodes 2 or --nnodes 1:4.") from None
    if not 1 <= low <= high:
        raise InvalidArgumentError(f"--nnodes needs 1 <= MIN <= MAX. Received: {value!r}. Example: --nnodes 2 or --nnodes 1:4.")
    return low, high


def usable_cores() -> int:
    """Return the CPU cores this process may run on (``--nproc-per-node cpu``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def launch_parser(prog: str = "towers launch") -> argparse.ArgumentParser:
    """Return torchrun's argument parser with towers' flags added (imports torch).

    The additions: ``--strategy``, ``--num-ps`` and ``--[no-]tolerate-worker-failures``.
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    # A script's own flags follow it: `--signal` must reach the script, not be read as torchrun's
    # `--signals-to-handle` (argparse matches prefixes of options before the script's arguments).
    parser.allow_abbrev = False
    parser.description = ("Run a training script on N processes per node: torchrun's flags, plus --strategy, "
                          "--num-ps and --[no-]tolerate-worker-failures. Workers get torchrun's variables (RANK, "
                          "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...), TOWERS_STRATEGY/TOWERS_NUM_PS, "
                          "and OMP_NUM_THREADS = cores // nproc-per-node unless set.")
    parser.set_defaults(monitor_interval=DEFAULT_MONITOR_INTERVAL_S)
    group = parser.add_argument_group("towers")
    group.add_argument("--strategy", default=None, metavar="NAME",
                       help=f"strategy the script's towers.strategy_from_env() builds: {', '.join(STRATEGY_NAMES)} "
                            "(alias: parameter_server); sets TOWERS_STRATEGY for every worker")
    group.add_argument("--num-ps", "--num_ps", type=int, default=None, metavar="K",
                       help="parameter-server processes (the last K ranks; implies --strategy ps); sets TOWERS_NUM_PS")
    group.add_argument("--strategy-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an option of the --strategy (repeatable), e.g. --strategy-option mode=async "
                            "--strategy-option staleness=2; the strategy must take it (sets TOWERS_STRATEGY_OPTIONS)")
    group.add_argument("--tolerate-worker-failures", default=None,
                       action=argparse.BooleanOptionalAction,
                       help="--strategy ps only (default: on there): a non-chief worker that fails does not stop the "
                            "job; the launcher names it and the others finish, taking over its batches. The chief or a ps "
                            "task failing always stops it. Such a worker "
                            "death never triggers --max-restarts; --no-tolerate-worker-failures makes it stop (or "
                            "restart) the whole job, as torchrun does")
    group.add_argument("--group-restarts", type=int, default=None, metavar="N",
                       help="--strategy fault_tolerant only: how many times each process (one replica group) is "
                            f"restarted alone when it dies, while the others train on (default {DEFAULT_GROUP_RESTARTS}); "
                            "towers launch also runs the job's torchft lighthouse on node 0 unless "
                            "TORCHFT_LIGHTHOUSE or --strategy-option lighthouse=http://HOST:PORT names one")
    group.add_argument("--group-size", type=int, default=1, metavar="N",
                       help="--strategy fault_tolerant only: processes per replica group (default 1), on one node; "
                            "--nproc-per-node must be a multiple. A group's processes are lost and restarted together")
    group.add_argument("--interface", default=None, metavar="NAME",
                       help="network interface for every link of the job (Gloo/NCCL collectives, parameter "
                            "servers), e.g. eth0; sets GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME and TOWERS_INTERFACE. "
                            "Default: across nodes, the interface that routes to the other nodes")
    group.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                       help="how long nodes and processes wait for each other at start-up before the job stops "
                            "with a message naming the missing ones (default: TOWERS_JOIN_TIMEOUT_S, else 300); "
                            "while waiting, node 0 and the chief say every ~15 s who joined and who is missing; "
                            "sets TOWERS_JOIN_TIMEOUT_S for every worker")
    group.add_argument("--mesh", default=None, metavar="DIMS",
                       help="--strategy sharded or mirrored: the processes as a device mesh, e.g. dp=2,tp=2 (tensor "
                            "parallelism within each model replica, FSDP2 or DDP across them; pp=N: pipeline stages, "
                            "sharded only); the same as --strategy-option mesh=DIMS")
    group.add_argument("--bitwise", action="store_true",
                       help="one device's maths bit for bit at any process count (--strategy one_device, mirrored, "
                            "multi_worker_mirrored, sharded, ft, ps with mode=sync, hybrid; with --strategy-option "
                            "micro_batch_size=M); the same as --strategy-option bitwise=true")
    group.add_argument("--ledger", default=None, metavar="DIR",
                       help="keep a ledger of which examples each committed update trained under DIR/ledger "
                            "(sets TOWERS_LEDGER_DIR for every process); `towers verify --ledger DIR` proves from it, "
                            "after the job, that each example of each completed epoch was trained exactly once")
    return parser


def with_bitwise(options: dict[str, Any], bitwise: bool) -> dict[str, Any]:
    """``options`` with ``--bitwise`` as the strategy option ``bitwise=true`` (a strategy-option given too is kept)."""
    return {**options, "bitwise": "true"} if bitwise and "bitwise" not in options else options


def with_mesh(options: dict[str, Any], mesh: str | None) -> dict[str, Any]:
    """``options`` with ``--mesh``'s value as the strategy option ``mesh``.

    Raises:
        ValueError: a mesh given both as --mesh and as --strategy-option mesh=, or one that does not parse.
    """
    if mesh is None:
        return options
    if "mesh" in options:
        raise InvalidArgumentError(f"The mesh is given twice: --mesh {mesh} and --strategy-option mesh={options['mesh']}. "
                                   "Give it once.")
    from towers.cluster.mesh import parse_mesh

    parse_mesh(mesh)  # a typo fails here, before any process starts
    return {**options, "mesh": mesh}

