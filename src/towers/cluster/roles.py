"""The one table of strategy names and process roles (no torch).

``towers launch``, the strategies' registry, ``towers bench``, ``towers demo`` and the cluster
description all read this table, so a strategy's name, its aliases and which of a job's ranks
are replicas, workers or parameter-server tasks are written down once. Adding a strategy is one
module under ``towers/strategies/`` plus one ``StrategyEntry`` row here.

Process layouts:

- ``"replicas"``: every process is a replica; rank 0 is the chief.
- ``"workers+ps"``: the last ``num_ps`` ranks are ps tasks (``ps:0 .. ps:K-1``), the others are
  workers and replicas (``worker:0`` is the chief) — TF_CONFIG's order (chief, workers, ps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from towers.errors import InvalidArgumentError

__all__ = [
    "LAYOUTS",
    "StrategyEntry",
    "STRATEGIES",
    "canonical_strategy",
    "strategy_entry",
    "strategy_names",
    "check_num_ps",
    "ps_ranks",
    "process_role",
]

#: Process layouts a strategy can have.
LAYOUTS = ("replicas", "workers+ps")


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy: its name, where its class lives, its aliases and how a job's ranks are laid out."""

    name: str
    #: ``"module:Class"``, imported only when the strategy is built.
    target: str
    aliases: tuple[str, ...] = ()
    layout: str = "replicas"
    #: False when the strategy runs one process only.
    multi_process: bool = True
    #: Options that make the strategy synchronous (same maths as one device); None when it cannot be.
    same_maths_options: Mapping[str, Any] | None = field(default_factory=dict)
    #: True when the job can go on after a non-chief worker dies (``towers launch`` then tolerates it by default).
    survives_dead_worker: bool = False
    #: True when a lost replica (group) is restarted alone while the others train on (``towers launch`` then runs
    #: a lighthouse on node 0 and restarts each lost process by itself).
    restarts_lost_replica: bool = False
    summary: str = ""
    #: How ``towers plan`` counts a replica's memory: ``"mirrored"`` (every replica holds the whole model and its
    #: gradients, DDP's buckets), ``"sharded"`` (FSDP2: split over the replicas); None: the plan does not model it.
    plan_memory: str | None = None
    #: True when the strategy takes a parallel layout (``--mesh dp=2,tp=2``, ``pp=2,dp=2``).
    takes_mesh: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"StrategyEntry {self.name!r}: layout must be one of {LAYOUTS}. Received: "
                                       f"{self.layout!r}.")
        if ":" not in self.target:
            raise InvalidArgumentError(f"StrategyEntry {self.name!r}: target must be 'module:Class'. Received: {self.target!r}.")

    @property
    def has_ps(self) -> bool:
        """True when some of the job's ranks are parameter-server tasks."""
        return self.layout == "workers+ps"


STRATEGIES: tuple[StrategyEntry, ...] = (
    StrategyEntry("one_device", "towers.strategies.one_device:OneDeviceStrategy", ("onedevice", "single"),
                  multi_process=False, plan_memory="mirrored",
                  summary="one replica on one device: the reference the others match"),
    StrategyEntry("mirrored", "towers.strategies.mirrored:MirroredStrategy", plan_memory="mirrored", takes_mesh=True,
                  summary="one replica per local device, gradients all-reduced (DDP)"),
    StrategyEntry("multi_worker_mirrored", "towers.strategies.mirrored:MultiWorkerMirroredStrategy",
                  ("multiworkermirrored", "mwms"), plan_memory="mirrored", summary="mirrored replicas across machines"),
    StrategyEntry("ps", "towers.strategies.parameter_server:ParameterServerStrategy",
                  ("parameter_server", "parameterserver"), layout="workers+ps",
                  same_maths_options={"mode": "sync"}, survives_dead_worker=True,
                  summary="parameters on ps tasks; workers push gradients, async or sync"),
    StrategyEntry("hybrid", "towers.strategies.hybrid:HybridStrategy", ("hybrid_ps",), layout="workers+ps",
                  same_maths_options={"mode": "sync"},
                  summary="dense layers all-reduced among workers, sharded embedding rows on ps tasks"),
    StrategyEntry("sharded", "towers.strategies.fully_sharded:FullyShardedStrategy", ("fsdp", "fully_sharded"),
                  plan_memory="sharded", takes_mesh=True,
                  summary="parameters, gradients and optimizer state sharded over the replicas (FSDP2)"),
    StrategyEntry("fault_tolerant", "towers.strategies.fault_tolerant:FaultTolerantStrategy", ("ft", "torchft"),
                  restarts_lost_replica=True,
                  summary="replicas that survive a lost one: a quorum per step, the lost one restarted alone (torchft)"),
)


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "_")


_BY_KEY = {_key(alias): entry for entry in STRATEGIES for alias in (entry.name, *entry.aliases)}


def strategy_names(*, aliases: bool = False) -> list[str]:
    """Return the strategy names (and their aliases with ``aliases=True``), in table order."""
    if aliases:
        return [n for entry in STRATEGIES for n in (entry.name, *entry.aliases)]
    return [entry.name for entry in STRATEGIES]


def strategy_entry(name: str) -> StrategyEntry:
    """Return the table row of ``name`` (a name or an alias, any case, ``-`` or ``_``).

    Raises:
        ValueError: when no strategy has that name; the message lists the names.
    """
    entry = _BY_KEY.get(_key(name))
    if entry is None:
        aliases = sorted(a for e in STRATEGIES for a in e.aliases)
        raise InvalidArgumentError(
            f"Unknown strategy {name!r}. Expected one of: {', '.join(strategy_names())} (aliases: "
            f"{', '.join(aliases)}). Pick one of these, e.g. `towers launch --strategy mirrored`.")
    return entry


def canonical_strategy(name: str) -> str:
    """Return the canonical name of strategy ``name`` (``"parameter_server"`` -> ``"ps"``).

    Raises:
        ValueError: when no strategy has that name; the message lists the names.
    """
    return strategy_entry(name).name


def check_num_ps(num_ps: int, world_size: int, *, source: str = "num_ps",
                 hint: str = "towers launch --strategy ps --num-ps 1 --nproc-per-node 3 script.py") -> None:
    """Check that ``num_ps`` parameter-server tasks among ``world_size`` processes leave at least one worker.

    ``source`` names where the value came from in the message (``--num-ps``, ``TOWERS_NUM_PS``, ...).

    Raises:
        ValueError: when ``num_ps`` is not an integer >= 0 or leaves no worker.
    """
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 0:
        raise InvalidArgumentError(f"{source} must be an integer >= 0. Received: {num_ps!r}. Example: {source}=1.")
    if num_ps >= world_size:
        raise InvalidArgumentError(
            f"{source}={num_ps} leaves no worker: the job has {world_size} process(es) and the last {num_ps} would "
            f"all be ps tasks. Expected {source} < {world_size} (the number of processes). Received: {num_ps}. Use "
            f"fewer ps tasks or start more processes, e.g. `{hint}`.")


def ps_ranks(world_size: int, num_ps: int) -> tuple[int, ...]:
    """Return the ranks of the ps tasks: the last ``num_ps`` of ``world_size``."""
    return tuple(range(world_size - num_ps, world_size))


def process_role(rank: int, world_size: int, num_ps: int) -> tuple[str, int]:
    """Return ``("worker", index)`` or ``("ps", index)`` for ``rank`` when the last ``num_ps`` ranks are ps tasks.

    Without ps tasks every rank is ``("worker", rank)``; worker 0 is the chief.
    """
    num_workers = world_size - num_ps
    return ("ps", rank - num_workers) if rank >= num_workers else ("worker", rank)
