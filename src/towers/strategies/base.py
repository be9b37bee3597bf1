"""The Strategy interface, the replica context and the registry of strategy names.

A strategy owns *how* replicas cooperate (devices, processes, gradient exchange); user code
only calls the methods below, so one script runs unchanged under every strategy.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import math
import os
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from towers import checkpoint
from towers._logging import get_logger
from towers._rng import fork_replica_stream, owns_stream
from towers.checkpoint.api import load_plain_state_dict, plain_state_dict
from towers.checkpoint.layout import CheckpointIO
from towers.cluster import roles
from towers.cluster.info import ProcessInfo
from towers.cluster.launch_notes import note_strategy_built
from towers.data import BatchInfo, InputContext, find_batch_info
from towers.errors import user_error
from towers.strategies._compile import compile_module, compile_options
from towers.strategies._loss_weights import UpdateWeights
from towers.strategies.precision import Precision

__all__ = [
    "strategy_options",
    "check_strategy_options",
    "REDUCE_OPS",
    "Strategy",
    "ReplicaContext",
    "current_strategy",
    "current_replica_context",
    "register_strategy",
    "get_strategy",
    "strategy_names",
    "strategy_from_env",
    "PeerLostError",
    "note_built",
]

log = get_logger(__name__)

#: Reductions accepted by ``Strategy.reduce``.
REDUCE_OPS = ("sum", "mean", "max", "min")

_current_strategy: contextvars.ContextVar["Strategy | None"] = contextvars.ContextVar("towers_strategy", default=None)
_current_replica: contextvars.ContextVar["ReplicaContext | None"] = contextvars.ContextVar("towers_replica", default=None)


class PeerLostError(RuntimeError):
    """A collective over the live replicas failed: one of them was lost since the current step began.

    Raised only by strategies that survive a lost replica (``FaultTolerantStrategy``): the caller
    may go on, since the next step's replicas leave the lost one out. Other strategies end the job.
    """


def check_max_norm(max_norm: Any) -> None:
    """Refuse a gradient-clipping bound that is not a positive finite number (torch clips everything to 0 then)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < math.inf:
        raise ValueError(f"max_norm must be a positive finite number. Received: max_norm={max_norm!r}. Use the "
                         "largest gradient norm you accept, e.g. 1.0; to not clip, do not call clip_grad_norm_.")


class ReplicaContext:
    """What code inside ``strategy.run`` knows about its step: replica id, replica count, global batch size.

    ``global_batch_size`` is the number of examples (over all replicas) whose mean gradient the
    next optimizer update takes: the global batch, or under gradient accumulation the sum of the
    update's micro-batches. It comes from the batch ``run`` was given (None when that batch did
    not come from ``distribute_dataset``). ``num_padding_examples`` trailing examples of this
    replica's batch are padding (weight zero). ``accumulation_steps`` is the number of
    micro-batches in the current update (1 without accumulation); ``is_update_step`` is True on
    the last of them. TF's names work too: ``replica_id_in_sync_group``, ``all_reduce``.
    """

    def __init__(self, strategy: "Strategy", *, global_batch_size: int | None = None,
                 num_padding_examples: int = 0, accumulation_steps: int = 1, is_update_step: bool = True):
        self.strategy = strategy
        self.replica_id = strategy.replica_id
        self.num_replicas_in_sync = strategy.num_replicas_in_sync
        self.global_batch_size = global_batch_size
        self.num_padding_examples = num_padding_examples
        self.accumulation_steps = accumulation_steps
        self.is_update_step = is_update_step

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index (tf.distribute's name for ``replica_id``)."""
        return self.replica_id

    def all_reduce(self, op: str, value: Any) -> torch.Tensor:
        """Return ``value`` combined across replicas with ``op`` (``"sum"``, ``"mean"``, ``"max"``, ``"min"``)."""
        return self.strategy.reduce(op, value)

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id={self.replica_id}, num_replicas_in_sync={self.num_replicas_in_sync}, "
                f"global_batch_size={self.global_batch_size}, num_padding_examples={self.num_padding_examples}, "
                f"accumulation_steps={self.accumulation_steps}, is_update_step={self.is_update_step})")


def note_built(info: ProcessInfo, name: str) -> None:
    """Tell ``towers launch`` (when it started this process with ``--strategy``) that strategy ``name`` was built.

    Every strategy calls it while it is constructed, so the launcher can say when a job never
    used the strategy it was started with (``ProcessInfo.launch_dir``; nothing outside it).
    """
    if info.launch_dir:
        note_strategy_built(info.launch_dir, rank=info.rank, name=name)


def current_strategy() -> "Strategy | None":
    """Return the strategy whose ``scope()`` or ``run()`` encloses this code, or None."""
    return _current_strategy.get()


def current_replica_context() -> ReplicaContext | None:
    """Return the replica context of the enclosing ``strategy.run``, or None outside one."""
    return _current_replica.get()


class Strategy(ABC):
    """How replicas cooperate. Subclasses implement the abstract methods; user code calls only these.

    A strategy owns everything that depends on it: device placement, wrapping (``prepare``),
    gradient synchronisation and accumulation, precision (``self.precision``), model and
    optimizer state (``state_dict``/``load_state_dict``), the checkpoint format
    (``save_checkpoint``/``load_checkpoint``) and the collectives. Every method that
    communicates is a collective: every replica calls it, in the same order.
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

    @property
    @abstractmethod
    def precision(self) -> Precision:
        """The precision object this strategy computes with (``.name``: ``"32"``, ``"bf16"`` or ``"fp16"``)."""

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
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False) -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)`` ready for this strategy (moved, wrapped, synchronised).

        ``compile=True`` (or a dict of ``torch.compile`` options) compiles the model after the
        strategy's own wrapping.
        """

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module inside whatever ``prepare`` wrapped (and compiled) it in."""
        model = self._compiled_from().get(id(model), model)
        return getattr(model, "module", model)

    def _compile(self, module: nn.Module, compile: bool | Mapping[str, Any]) -> nn.Module:
        """Return ``module`` compiled as ``prepare(..., compile=)`` asks (itself when not); ``unwrap`` sees through it."""
        options = compile_options(compile)
        if options is None:
            return module
        compiled = compile_module(module, options, self.device)
        self._compiled_from()[id(compiled)] = module
        return compiled

    def _compiled_from(self) -> dict[int, nn.Module]:
        """id(compiled module) -> the module it compiles, for the modules ``prepare`` compiled."""
        return self.__dict__.setdefault("_compiled_modules", {})

    @abstractmethod
    def distribute_dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                           drop_remainder: bool = False) -> Any:
        """Return an iterable (once per epoch) of this replica's share of each global batch, on its device."""

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any]) -> Any:
        """Return ``dataset_fn(input_context)``: this replica's own input pipeline (tf.distribute's per-worker function).

        ``input_context`` says which pipeline this is (``input_pipeline_id`` of
        ``num_input_pipelines``: one per replica), ``get_per_replica_batch_size(B)`` and the
        replica's ``device``. The function shards and batches the data itself, and its batches are
        returned as they are: they carry no accounting, so pass ``global_batch_size=`` to
        ``compute_average_loss`` under several replicas, and give every replica the same number of
        batches. For exact global batches, return ``towers.data.distribute_dataset(data, B,
        num_replicas=ctx.num_input_pipelines, replica_id=ctx.input_pipeline_id, device=ctx.device)``
        from the function instead: its batches carry their accounting.

        Raises:
            TypeError: when ``dataset_fn`` is not callable.
        """
        if not callable(dataset_fn):
            raise TypeError(f"distribute_datasets_from_function expects a function of an InputContext. Received: "
                            f"{type(dataset_fn).__name__}. Example: strategy.distribute_datasets_from_function("
                            "lambda ctx: my_batches(shard=ctx.input_pipeline_id, num_shards=ctx.num_input_pipelines)).")
        n = self.num_replicas_in_sync
        return dataset_fn(InputContext(num_input_pipelines=n, input_pipeline_id=self.replica_id,
                                       num_replicas_in_sync=n, device=self.device))

    # --- steps and communication ------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this replica's step and return its per-replica result.

        The step's accounting (global batch size, padding, accumulation window) is read from the
        batch in ``args``/``kwargs`` as ``distribute_dataset`` yielded it.
        """
        kwargs = dict(kwargs or {})
        self._own_random_stream()
        with self._entered(self._replica_context(find_batch_info(args, kwargs))):
            return fn(*args, **kwargs)

    def _own_random_stream(self) -> None:
        """At this replica's first step (and after the script seeds again): fork a stream of its own (replica 0 keeps
        the script's).

        The script's ``torch.manual_seed`` gave every replica the same initial weights; from the first step
        on, dropout masks and other draws differ between replicas (``towers._rng``)."""
        if self.replica_id > 0 and not owns_stream(self.replica_id):  # first step, or the script seeded again
            fork_replica_stream(self.replica_id)

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

    def _enter_until_next_step(self, context: ReplicaContext) -> None:
        """Make ``context`` the current replica context (and this the current strategy) without a scope to leave.

        For a loop without ``strategy.run``: the step a prepared model's forward started lasts until the next one.
        """
        _current_strategy.set(self)
        _current_replica.set(context)

    def _replica_context(self, batch: BatchInfo | None) -> ReplicaContext:
        """The context ``run`` enters for a step on a batch carrying ``batch`` (None: unknown)."""
        if batch is None:
            return ReplicaContext(self)
        return ReplicaContext(self, global_batch_size=batch.examples_per_update,
                              num_padding_examples=batch.num_padding_examples,
                              accumulation_steps=batch.batches_per_update, is_update_step=batch.last_in_update)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` under this strategy's precision (fp16 scales the whole loss first).

        ``loss.backward()`` does the same in ``"32"`` and ``"bf16"``; under fp16 use this.
        """
        self.precision.scale_loss(loss).backward()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of ``parameters`` to a total norm of ``max_norm``; return the norm before clipping.

        Call it after backward and before ``optimizer.step()``; fp16 gradients are unscaled first.
        Under gradient accumulation it clips once per update, on the last micro-batch, when the
        gradient is complete (summed over the micro-batches and, where replicas synchronise, over
        the replicas): on the other micro-batches it changes nothing and returns the norm of the
        gradient accumulated so far on this replica (unscaled). One device's result, at any
        accumulation and replica count.

        Raises:
            ValueError: ``max_norm`` is not a positive finite number.
        """
        check_max_norm(max_norm)
        if not self._updates_now():
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
            norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), norm_type).cpu()
                                                          for g in grads]), norm_type) if grads else torch.zeros(()))
            return norm / self.precision.scale if self.precision.needs_loss_scaling else norm
        self._finish_loss_weights("clip")
        for optimizer in self._prepared_optimizers():
            self.precision.unscale_gradients(optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def _updates_now(self) -> bool:
        """True unless the step in progress is a micro-batch that accumulates without updating."""
        context = current_replica_context()
        return context is None or context.is_update_step

    def _prepared_optimizers(self) -> list[torch.optim.Optimizer]:
        """The user's optimizers this strategy prepared (their gradients are what fp16 unscales)."""
        return []

    @property
    def _loss_weights(self) -> UpdateWeights:
        """This replica's loss weights in the update in progress (``compute_average_loss(weights=...)``)."""
        return self.__dict__.setdefault("_update_weights", UpdateWeights())

    def _check_weighted_loss(self) -> None:
        """Raise when this strategy cannot normalise a loss by the update's global weight.

        The division happens in the prepared optimizer's ``step()`` (or ``clip_grad_norm_``): without a
        prepared optimizer the gradient would silently stay the weighted sum.
        """
        if not self._prepared_optimizers():
            raise user_error(
                "compute_average_loss(..., weights=...) divides the gradient by the update's global weight when the "
                "optimizer returned by strategy.prepare steps, and this strategy prepared no optimizer",
                f"{type(self).__name__} with no prepared optimizer",
                "Prepare the optimizer with the model: model, optimizer = strategy.prepare(model, optimizer), and call "
                "that optimizer's step().")

    def _finish_loss_weights(self, when: str = "step") -> None:
        """At an update step: divide the gradients by the update's global loss weight, when its losses were weighted.

        Called as the update step's backward ends (``"backward"``), and again in ``clip_grad_norm_`` (``"clip"``) and
        as the optimizer steps (``"step"``), which find nothing left to divide and refuse a loss no towers
        normaliser produced."""
        params = [p for optimizer in self._prepared_optimizers() for group in optimizer.param_groups
                  for p in group["params"]]
        self._loss_weights.finish(params, lambda total: self.reduce("sum", total), when=when,
                                  replicas_summed=self.num_replicas_in_sync if self._sums_replica_gradients else 1)

    @property
    def _sums_replica_gradients(self) -> bool:
        """True where an update is the SUM of the replicas' gradients (one device's only for normalised losses)."""
        return True

    def _finish_after_backward(self, loss: torch.Tensor) -> None:
        """Divide the update's gradients by its global weight as the backward through ``loss`` ends.

        A hook on ``loss`` queues a callback at the start of its backward; the callback queues the
        division once more, so that it runs after the callbacks DDP and FSDP queue during the same
        backward (their gradient all-reduce / reduce-scatter): ``p.grad`` is final when backward returns.
        """
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def after_the_strategys_callbacks() -> None:
            engine.queue_callback(lambda: self._finish_loss_weights("backward"))

        def at_backward_start(grad: torch.Tensor) -> torch.Tensor:
            engine.queue_callback(after_the_strategys_callbacks)
            return grad

        loss.register_hook(at_backward_start)

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

    def shutdown(self) -> None:  # noqa: B027 (a no-op by default, not abstract: most strategies start nothing)
        """Release processes, groups and servers this strategy started (idempotent)."""

    # --- state and checkpoints -----------------------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Return ``{"model", "optimizer", "precision"}``: the training state of a prepared model and optimizer.

        The model's is the user's module's ``state_dict()`` (full tensors, or this process's shards
        as DTensors under a sharded strategy); the optimizer's is keyed by parameter NAME, not by
        torch's position, so it loads under any strategy. Plain tensors, numbers, strings, lists and
        dicts only. A collective where the state lives elsewhere (shards): every replica calls it.
        """
        return {**plain_state_dict(self.unwrap(model), optimizer), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Restore what ``state_dict`` returned (under this or another strategy) into a prepared model and optimizer.

        Every replica calls it. The optimizer loads first: torch checks its state before changing anything.
        """
        load_plain_state_dict(state, self.unwrap(model), optimizer)
        self.precision.load_state_dict(state.get("precision") or {})

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Return the user's module's full (unsharded) ``state_dict()``; a collective where it is sharded."""
        return self.unwrap(model).state_dict()

    def export_model(self, model: nn.Module, path: str | os.PathLike[str]) -> Any:
        """Write the user's module's full weights to ``path`` for inference (safetensors or a torch file); every replica calls it.

        The same as ``towers.checkpoint.export_model(model, path, strategy=self)``; returns the path.
        """
        return checkpoint.export_model(model, path, strategy=self)

    def checkpoint_io(self) -> CheckpointIO:
        """How this strategy's processes write checkpoint tensors (every process its part, by default)."""
        return self.__dict__.setdefault("_checkpoint_io", CheckpointIO(collective=True))

    def save_checkpoint(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
        """Write ``state`` (your dict: model, optimizer, data, values) as a checkpoint at ``path``; every replica calls it.

        The same as ``towers.checkpoint.save_checkpoint(path, state, strategy=self)``; any strategy restores it.
        """
        return str(checkpoint.save_checkpoint(path, state, strategy=self))

    def restore_checkpoint(self, path: str | os.PathLike[str], objects: Mapping[str, Any]) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``objects`` (``{"model": model, ...}``) and return all it holds.

        The same as ``towers.checkpoint.restore_checkpoint(path, objects, strategy=self)``.
        """
        return checkpoint.restore_checkpoint(path, objects, strategy=self)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Return the dict saved at ``path`` (tensors whole, on the CPU); every replica reads it."""
        return checkpoint.load_checkpoint(path, strategy=self)

    def checkpoint_exists(self, path: str | os.PathLike[str]) -> bool:
        """Return True when a complete checkpoint is published at ``path``."""
        return checkpoint.checkpoint_exists(path)

    def delete_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` and everything it holds; call it on the chief (nothing if absent)."""
        checkpoint.delete_checkpoint(path)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint in flight (if any) is written and visible at its path."""
        self.checkpoint_io().wait(is_chief=self.is_chief, broadcast_object=self.broadcast_object)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self.replica_id}/{self.num_replicas_in_sync}, "
                f"device={self.device})")


# --- registry ---------------------------------------------------------------------------------
# Built-in strategies are rows of towers.cluster.roles.STRATEGIES (imported when first built);
# register_strategy adds a user's own at run time.
_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def _key(name: str) -> str:
    return str(name).strip().lower().replace("-", "_")


def register_strategy(name: str, factory: Callable[..., Strategy], *, aliases: Sequence[str] = ()) -> None:
    """Make ``factory`` available as ``get_strategy(name)`` (and under each alias), beside the built-in names."""
    for key in (name, *aliases):
        _REGISTRY[_key(key)] = factory


def strategy_names() -> list[str]:
    """Return every strategy name and alias (built-in and registered), sorted."""
    return sorted({*roles.strategy_names(aliases=True), *_REGISTRY})


def _factory(name: str) -> Callable[..., Strategy]:
    factory = _REGISTRY.get(_key(name))
    if factory is None:
        module, _, attr = roles.strategy_entry(name).target.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory


def get_strategy(name: str, **kwargs: Any) -> Strategy:
    """Return a new strategy named ``name`` (e.g. ``"mirrored"``), built with ``kwargs``.

    Raises:
        ValueError: when no strategy has that name; the message lists the names.
    """
    strategy = _factory(name)(**kwargs)
    note_built(strategy.process_info, name)  # a strategy registered from outside towers, too
    return strategy


def strategy_options(name: str) -> set[str] | None:
    """Return the keyword options strategy ``name`` takes (None: any, its factory takes ``**kwargs``)."""
    parameters = inspect.signature(_factory(name)).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {"self", "info"}


def _takers(option: str) -> list[str]:
    names = sorted({roles.canonical_strategy(n) if n in roles.strategy_names(aliases=True) else n
                    for n in strategy_names()})
    return [n for n in names if (taken := strategy_options(n)) is None or option in taken]


def check_strategy_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise when strategy ``name`` does not take one of ``options`` (``--strategy-option``: it must take each one).

    What ``strategy_from_env`` checks in every process of ``towers launch``; ``towers k8s`` checks the
    same before it writes a manifest.

    Raises:
        ValueError: naming the option, the strategies that take it, and the options ``name`` takes; or when no
            strategy is named ``name``.
    """
    taken = strategy_options(name)
    if taken is None:
        return
    for key, value in options.items():
        if key not in taken:
            others = [n for n in _takers(key) if n != name]
            raise ValueError(
                f"Strategy {name!r} does not take the option {key!r}. Received: --strategy-option {key}={value!r} "
                f"(TOWERS_STRATEGY_OPTIONS). {f'{key!r} is an option of {others}; ' if others else ''}{name!r} takes "
                f"{sorted(taken)}. Drop it or pick another --strategy.")


def _options_for(name: str, launcher: Mapping[str, Any], script: Mapping[str, Any]) -> dict[str, Any]:
    """The options strategy ``name`` gets: the launcher's (which it must take) over the script's own."""
    check_strategy_options(name, launcher)
    taken = strategy_options(name)
    if taken is None:
        return {**script, **launcher}
    options = {}
    for key, value in script.items():
        if key in taken:
            options[key] = value
            continue
        others = _takers(key)
        if not others:
            raise TypeError(f"strategy_from_env() got an option no strategy takes. Received: {key}={value!r}. "
                            f"{name!r} takes {sorted(taken)}.")
        # The same script runs under every strategy: an option of another one is not this one's business.
        log.debug("strategy %s does not take %s=%r (an option of %s): not passed", name, key, value, others)
    return {**options, **launcher}


def strategy_from_env(info: ProcessInfo | None = None, **kwargs: Any) -> Strategy:
    """Return the strategy ``towers launch --strategy`` (or TF_CONFIG, torchrun, SLURM) asked for.

    Without a request: ``one_device`` for a single process, ``mirrored`` on one host,
    ``multi_worker_mirrored`` across hosts. ``kwargs`` are the script's options: each goes to the
    strategy when it takes it, and is left out when only other strategies take it (so
    ``strategy_from_env(mode="sync")`` runs under Mirrored too). Options from outside
    (``towers launch --strategy-option``) win over them, and the strategy must take each one.

    Raises:
        ValueError: an option from outside that the strategy does not take (naming those that do).
        TypeError: an option of the script that no strategy takes.
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
    return get_strategy(name, info=info, **_options_for(name, info.strategy_options, kwargs))
