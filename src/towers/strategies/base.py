"""The Strategy interface, the replica context and the registry of strategy names.

A strategy owns *how* replicas cooperate (devices, processes, gradient exchange); user code
only calls the methods below, so one script runs unchanged under every strategy.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from towers._logging import get_logger
from towers._rng import fork_replica_stream, owns_stream
from towers.cluster.info import ProcessInfo
from towers.data import BatchInfo, InputContext, find_batch_info
from towers.errors import InvalidTypeError
from towers.strategies._compile import compile_module, compile_options
from towers.strategies._loss_weights import StrategyLossWeights
from towers.strategies._strategy_checkpoints import StrategyCheckpoints
from towers.strategies.context import PeerLostError, ReplicaContext, check_max_norm
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


def current_strategy() -> "Strategy | None":
    """Return the strategy whose ``scope()`` or ``run()`` encloses this code, or None."""
    return _current_strategy.get()


def current_replica_context() -> ReplicaContext | None:
    """Return the replica context of the enclosing ``strategy.run``, or None outside one."""
    return _current_replica.get()


class Strategy(StrategyLossWeights, StrategyCheckpoints, ABC):
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
                compile: bool | Mapping[str, Any] = False, activation_checkpointing: str = "off") -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)`` ready for this strategy (moved, wrapped, synchronised).

        ``compile=True`` (or a dict of ``torch.compile`` options) compiles the model after the
        strategy's own wrapping. ``activation_checkpointing``: ``"off"``; ``"block"`` (each repeated block of
        the model, as ``shard_units="auto"`` finds them, keeps only its input and is recomputed in backward);
        ``"selective"`` (inside each block the matmul and attention outputs are kept, the cheap ops recomputed).
        Applied before the strategy's wrapping and ``compile``; parameter names and ``state_dict`` keys do not change.
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
            raise InvalidTypeError(f"distribute_datasets_from_function expects a function of an InputContext. Received: "
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

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Return ``(loss, outputs)`` after one forward and backward of ``model`` on ``inputs``.

        ``inputs`` is what the model takes: a tensor (``model(x)``), a tuple (``model(*inputs)``) or a dict
        (``model(**inputs)``). ``loss_fn(outputs, targets)`` returns the loss to backpropagate, normalised as
        in any step (``towers.compute_average_loss(per_example_loss)``); it is backpropagated with
        ``backward`` and returned detached. Here that is one forward, one loss and one backward; a strategy
        that runs a model in pieces (pipeline stages) runs its own schedule instead, calls ``loss_fn`` where
        the outputs are, and returns ``outputs`` None on the processes that do not hold them. The optimizer
        step stays the caller's.
        """
        if isinstance(inputs, Mapping):
            outputs = model(**inputs)
        else:
            outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        loss = loss_fn(outputs, targets)
        self.backward(loss)
        return loss.detach(), outputs

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
    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self.replica_id}/{self.num_replicas_in_sync}, "
                f"device={self.device})")


# The registry of strategy names (get_strategy, strategy_from_env, ...) lives in registry.py; re-exported here.
from towers.strategies.registry import (  # noqa: E402
    check_strategy_options,
    get_strategy,
    note_built,
    register_strategy,
    strategy_from_env,
    strategy_names,
    strategy_options,
)
