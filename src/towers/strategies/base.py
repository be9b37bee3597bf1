"""The Strategy interface, the replica context and the registry of strategy names.

A strategy owns *how* replicas cooperate (devices, processes, gradient exchange); user code
only calls the methods below, so one script runs unchanged under every strategy.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import torch
from torch import nn

from towers.cluster.info import ProcessInfo

__all__ = [
    "REDUCE_OPS",
    "Strategy",
    "ReplicaContext",
    "current_strategy",
    "current_replica_context",
    "register_strategy",
    "get_strategy",
    "strategy_names",
    "strategy_from_env",
]

#: Reductions accepted by ``Strategy.reduce``.
REDUCE_OPS = ("sum", "mean", "max", "min")

_current_strategy: contextvars.ContextVar["Strategy | None"] = contextvars.ContextVar("towers_strategy", default=None)
_current_replica: contextvars.ContextVar["ReplicaContext | None"] = contextvars.ContextVar("towers_replica", default=None)


class ReplicaContext:
    """What code inside ``strategy.run`` knows about its step: replica id, replica count, global batch size.

    ``global_batch_size`` is the number of examples (over all replicas) whose mean gradient the
    next optimizer update takes: the global batch, or under gradient accumulation the sum of the
    update's micro-batches (None when unknown). ``num_padding_examples`` trailing examples of
    this replica's batch are padding (weight zero). ``accumulation_steps`` is the number of
    micro-batches in the current update (1 without accumulation).
    """

    def __init__(self, strategy: "Strategy", *, global_batch_size: int | None = None,
                 num_padding_examples: int = 0, accumulation_steps: int = 1):
        self.strategy = strategy
        self.replica_id = strategy.replica_id
        self.num_replicas_in_sync = strategy.num_replicas_in_sync
        self.global_batch_size = global_batch_size
        self.num_padding_examples = num_padding_examples
        self.accumulation_steps = accumulation_steps

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id={self.replica_id}, num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"global_batch_size={self.global_batch_size}, num_padding_examples={self.num_padding_examples}, "
                f"accumulation_steps={self.accumulation_steps})")


def current_strategy() -> "Strategy | None":
    """Return the strategy whose ``scope()`` or ``run()`` encloses this code, or None."""
    return _current_strategy.get()


def current_replica_context() -> ReplicaContext | None:
    """Return the replica context of the enclosing ``strategy.run``, or None outside one."""
    return _current_replica.get()


class Strategy(ABC):
    """How replicas cooperate. Subclasses implement the abstract methods; user code calls only these.

    Every method that communicates is a collective: every replica calls it, in the same order.
    """

    #: Registry name (``towers.get_strategy(name)``, ``towers launch --strategy name``).
    name: ClassVar[str] = "base"

    # --- who am I -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def process_info(self) -> ProcessInfo:
        """This process's place in the job."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this replica computes on."""

    @property
    @abstractmethod
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each step (the global batch is split across them)."""

    @property
    @abstractmethod
    def replica_id(self) -> int:
        """This replica's index in ``[0, num_replicas_in_sync)``."""

    @property
    def is_chief(self) -> bool:
        """True on the one replica that writes logs, checkpoints and plots."""
        return self.replica_id == 0

    # --- placement and preparation ----------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Make this the current strategy; modules and tensors created inside land on ``self.device``."""
        token = _current_strategy.set(self)
        try:
            with torch.device(self.device):
                yield self
        finally:
            _current_strategy.reset(token)

    @abstractmethod
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)`` ready for this strategy (moved, wrapped, synchronised)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module inside whatever ``prepare`` wrapped it in."""
        return getattr(model, "module", model)

    @abstractmethod
    def distribute_dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                           drop_remainder: bool = False) -> Any:
        """Return an iterable (once per epoch) of this replica's share of each global batch, on its device."""

    # --- steps and communication ------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` in this replica's context and return its per-replica result."""
        with self._entered(self._replica_context()):
            return fn(*args, **dict(kwargs or {}))

    @contextlib.contextmanager
    def _entered(self, context: ReplicaContext) -> Iterator[None]:
        """Make this the current strategy and ``context`` the current replica context, restored on exit."""
        strategy_token = _current_strategy.set(self)
        replica_token = _current_replica.set(context)
        try:
            yield
        finally:
            _current_replica.reset(replica_token)
            _current_strategy.reset(strategy_token)

    def _replica_context(self) -> ReplicaContext:
        """The context ``run`` enters; subclasses add what they know about the current step."""
        return ReplicaContext(self)

    @abstractmethod
    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` across replicas with ``op`` in ``REDUCE_OPS``; every replica gets the result.

        With ``axis`` set, also reduce over that axis of each replica's value; ``"mean"`` then
        weights every element equally across ragged per-replica batches.
        """

    @abstractmethod
    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every replica's ``value`` along ``axis`` (ragged sizes allowed), in replica order."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every replica reaches this point."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return replica ``src``'s ``obj`` on every replica (picklable objects)."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every replica's ``obj``, in replica order."""
        return [obj]

    def shutdown(self) -> None:
        """Release processes, groups and servers this strategy started (idempotent)."""

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return training state the strategy owns that a checkpoint must carry (e.g. the fp16 loss scaler); ``{}`` by default.

        Plain tensors, numbers, strings, lists and dicts only (checkpoints load with ``weights_only=True``).
        A collective when the state lives elsewhere (e.g. on parameter servers): every replica calls it.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; every replica calls it with the same state."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self.replica_id}/{self.num_replicas_in_sync}, "
                f"device={self.device})")


# --- registry ---------------------------------------------------------------------------------
_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register_strategy(name: str, factory: Callable[..., Strategy], *, aliases: Sequence[str] = ()) -> None:
    """Make ``factory`` available as ``get_strategy(name)`` (and under each alias)."""
    for key in (name, *aliases):
        _REGISTRY[key.lower().replace("-", "_")] = factory


def strategy_names() -> list[str]:
    """Return every registered strategy name and alias, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    # Importing the package registers the built-in strategies.
    import towers.strategies  # noqa: F401


def get_strategy(name: str, **kwargs: Any) -> Strategy:
    """Return a new strategy registered as ``name`` (e.g. ``"mirrored"``), built with ``kwargs``.

    Raises:
        ValueError: when no strategy has that name; the message lists the names.
    """
    _load_builtin()
    key = str(name).lower().replace("-", "_")
    if key not in _REGISTRY:
        raise ValueError(
            f"Unknown strategy {name!r}. Expected one of: {', '.join(sorted(_REGISTRY))}. "
            "Pick one of these with `towers launch --strategy NAME`.")
    return _REGISTRY[key](**kwargs)


def strategy_from_env(info: ProcessInfo | None = None, **kwargs: Any) -> Strategy:
    """Return the strategy ``towers launch --strategy`` (or TF_CONFIG, torchrun, SLURM) asked for.

    Without a request: ``one_device`` for a single process, ``mirrored`` on one host,
    ``multi_worker_mirrored`` across hosts.
    """
    from towers import cluster

    info = info or cluster.from_env()
    name = info.strategy
    if name is None:
        if info.world_size == 1:
            name = "one_device"
        elif info.local_world_size == info.world_size:
            name = "mirrored"
        else:
            name = "multi_worker_mirrored"
    return get_strategy(name, info=info, **kwargs)
