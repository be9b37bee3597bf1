"""The Strategy interface; the replica context (``context.py``) and the registry of strategy names (``registry.py``),
re-exported.

A strategy owns *how* replicas cooperate (devices, processes, gradient exchange); user code
only calls the methods below, so one script runs unchanged under every strategy.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from towers import checkpoint
from towers._rng import fork_replica_stream, owns_stream
from towers.checkpoint.api import load_plain_state_dict, plain_state_dict
from towers.checkpoint.layout import CheckpointIO
from towers.cluster.info import ProcessInfo
from towers.data import BatchInfo, InputContext, find_batch_info
from towers.errors import InvalidTypeError
from towers.parallel.compile import CompiledModules
from towers.strategies._loss_weights import UpdateWeights, after_backward, no_optimizer_to_divide, prepared_parameters
from towers.strategies.context import (
    PeerLostError,
    ReplicaContext,
    accumulated_norm,
    check_max_norm,
    current_replica_context,
    current_strategy,
    entered,
    strategy_scope,
)
from towers.strategies.precision import Precision
from towers.strategies.registry import (
    check_strategy_options,
    get_strategy,
    note_built,
    register_strategy,
    strategy_from_env,
    strategy_names,
    strategy_options,
)

__all__ = ["strategy_options", "check_strategy_options", "REDUCE_OPS", "Strategy", "ReplicaContext", "current_strategy",
           "current_replica_context", "register_strategy", "get_strategy", "strategy_names", "strategy_from_env",
           "PeerLostError", "note_built"]

#: Reductions accepted by ``Strategy.reduce``.
REDUCE_OPS = ("sum", "mean", "max", "min")


class Strategy(ABC):
    """How replicas cooperate. Subclasses implement the abstract methods; user code calls only these.

    A strategy owns everything that depends on it: device placement, wrapping (``prepare``),
    gradient synchronisation and accumulation, precision (``self.precision``), model and
    optimizer state (``state_dict``/``load_state_dict``), the checkpoint format
    (``save_checkpoint``/``load_checkpoint``) and the collectives. Every method that
    communicates is a collective: every replica calls it, in the same order.

    What it holds besides: the loss weights of the update in progress (``_loss_weights``, an
    ``UpdateWeights``) and how its processes write checkpoint tensors (``checkpoint_io()``, a
    ``CheckpointIO``); the checkpoint format itself is ``towers.checkpoint``'s.
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
        """Make this the current strategy; modules and tensors created inside land on ``self.device``.

        Yields:
            The strategy itself (``with strategy.scope() as s:``).
        """
        with strategy_scope(self), torch.device(self.device):
            yield self

    @abstractmethod
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False, activation_checkpointing: str = "off") -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)`` ready for this strategy (moved, wrapped, synchronised).

        Args:
            model: the user's module, built on the CPU or under ``scope()``.
            optimizer: its optimizer (None: a model for inference or evaluation).
            compile: True (or a dict of ``torch.compile`` options) compiles the model after the strategy's own
                wrapping.
            activation_checkpointing: ``"off"``; ``"block"`` (each repeated block of the model, as
                ``shard_units="auto"`` finds them, keeps only its input and is recomputed in backward);
                ``"selective"`` (inside each block the matmul and attention outputs are kept, the cheap ops
                recomputed). Applied before the strategy's wrapping and ``compile``; parameter names and
                ``state_dict`` keys do not change.

        Returns:
            ``(model, optimizer)``: call the returned model in the step and step the returned optimizer.
        """

    def unwrap(self, model: nn.Module) -> nn.Module:
        """Return the user's module inside whatever ``prepare`` wrapped (and compiled) it in.

        Args:
            model: a model ``prepare`` returned (or any module: returned as it is).

        Returns:
            The user's own module, e.g. to save or inspect it.
        """
        model = self._compiled_modules.original(model)
        return getattr(model, "module", model)

    def _compile(self, module: nn.Module, compile: bool | Mapping[str, Any]) -> nn.Module:
        """Return ``module`` compiled as ``prepare(..., compile=)`` asks (itself when not); ``unwrap`` sees through it."""
        return self._compiled_modules.compile(module, compile, self.device)

    @property
    def _compiled_modules(self) -> CompiledModules:
        """The modules ``prepare`` compiled (made at the first use: a subclass's ``__init__`` need not call ours)."""
        return self.__dict__.setdefault("_compiled", CompiledModules())

    @abstractmethod
    def distribute_dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                           drop_remainder: bool = False) -> Any:
        """Return an iterable (once per epoch) of this replica's share of each global batch, on its device.

        Args:
            dataset: a map-style dataset, a tuple or dict of tensors, or a stream (``towers.data``).
            global_batch_size: the examples of one step over all replicas.
            shuffle: a new order every epoch, the same on every replica.
            seed: the order's seed.
            drop_remainder: leave out a last global batch smaller than ``global_batch_size``.

        Returns:
            A ``towers.data.DistributedDataset`` (or ``DistributedStream``): its batches carry their accounting,
            which ``run`` and ``compute_average_loss`` read.
        """

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

        Args:
            dataset_fn: a function of a ``towers.InputContext`` that returns this replica's batches.

        Returns:
            What ``dataset_fn`` returned.

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

        Args:
            fn: the step: forward, loss, backward, optimizer step.
            args: its positional arguments (the batch, as ``distribute_dataset`` yielded it).
            kwargs: its keyword arguments.

        Returns:
            What ``fn`` returned on this replica; ``reduce`` combines it across replicas.
        """
        kwargs = dict(kwargs or {})
        self._own_random_stream()
        with self._entered(self._replica_context(find_batch_info(args, kwargs))):
            return fn(*args, **kwargs)

    def _own_random_stream(self) -> None:
        """At this replica's first step (and after the script seeds again): fork a random stream of its own (replica 0
        keeps the script's): the same initial weights everywhere, then dropout masks that differ (``towers._rng``)."""
        if self.replica_id > 0 and not owns_stream(self.replica_id):  # first step, or the script seeded again
            fork_replica_stream(self.replica_id)

    def _entered(self, context: ReplicaContext) -> contextlib.AbstractContextManager[None]:
        """Make this the current strategy and ``context`` the current replica context, restored on exit."""
        return entered(self, context)

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

        Args:
            loss: the scalar loss of this replica's step.
        """
        self.precision.scale_loss(loss).backward()

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """Return ``(loss, outputs)`` after one forward and backward of ``model`` on ``inputs``.

        Here that is one forward, one loss and one backward (``backward``); a strategy that runs a model in
        pieces (pipeline stages) runs its own schedule instead and calls ``loss_fn`` where the outputs are.
        The optimizer step stays the caller's.

        Args:
            model: the prepared model.
            inputs: what the model takes: a tensor (``model(x)``), a tuple (``model(*inputs)``) or a dict
                (``model(**inputs)``).
            targets: what ``loss_fn`` compares the outputs with.
            loss_fn: ``loss_fn(outputs, targets)`` returns the loss to backpropagate, normalised as in any step
                (``towers.compute_average_loss(per_example_loss)``).

        Returns:
            The loss, detached, and the model's outputs (None on the processes of a pipeline that do not hold
            them).
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

        Args:
            parameters: the prepared model's parameters (or one tensor).
            max_norm: the largest total norm allowed.
            norm_type: the norm's order (2: Euclidean; ``inf``: the largest element).

        Returns:
            The total norm before clipping.

        Raises:
            ValueError: ``max_norm`` is not a positive finite number.
        """
        check_max_norm(max_norm)
        if not self._updates_now():
            return accumulated_norm(parameters, norm_type, self.precision)
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

        Args:
            op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
            value: a tensor or number (a step's result from ``run``).
            axis: also reduce over this axis of each replica's value.

        Returns:
            The combined value, the same on every replica.
        """

    @abstractmethod
    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every replica's ``value`` along ``axis`` (ragged sizes allowed), in replica order.

        Args:
            value: this replica's tensor.
            axis: the axis to concatenate along.

        Returns:
            Every replica's tensors, concatenated, on every replica.
        """

    @abstractmethod
    def barrier(self) -> None:
        """Block until every replica reaches this point."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return replica ``src``'s ``obj`` on every replica (picklable objects).

        Args:
            obj: the object (only ``src``'s is used).
            src: the replica that sends it.

        Returns:
            ``src``'s object.
        """
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every replica's ``obj``, in replica order.

        Args:
            obj: this replica's picklable object.

        Returns:
            One object per replica.
        """
        return [obj]

    def shutdown(self) -> None:  # noqa: B027 (a no-op by default, not abstract: most strategies start nothing)
        """Release processes, groups and servers this strategy started (idempotent)."""

    # --- the loss normalisers' hooks (towers.losses; not for user code) ------------------------------------------
    @property
    def _loss_weights(self) -> UpdateWeights:
        """This replica's loss weights in the update in progress (``compute_average_loss(weights=...)``)."""
        return self.__dict__.setdefault("_update_weights", UpdateWeights())

    def note_example_normalised_loss(self, *, update_step: bool) -> None:
        """Note a loss normalised by examples (``compute_average_loss`` without ``weights``, ``scale_regularization_loss``)
        in the update in progress (``update_step``: its last micro-batch).

        Args:
            update_step: True on the update's last micro-batch.

        Raises:
            ValueError: the update already holds a loss normalised by weights.
        """
        self._loss_weights.note_plain(update_step)

    def note_weighted_loss(self, loss: torch.Tensor, weight: float, *, update_step: bool) -> None:
        """Note a loss normalised by ``weight`` (``compute_average_loss(..., weights=...)``) in the update in progress:
        ``loss``'s gradient is the weighted SUM, divided by the update's global weight as the backward through it ends
        at the update step (``update_step``).

        Args:
            loss: the loss whose backward ends the update (at the update step).
            weight: this share's sum of weights.
            update_step: True on the update's last micro-batch.

        Raises:
            NotImplementedError: this strategy cannot normalise by weights.
            ValueError: this strategy prepared no optimizer, or the update mixes weighted and example-normalised
                losses, or its gradient was divided already.
        """
        self._check_weighted_loss()
        self._loss_weights.note_weighted(weight, update_step)
        if update_step:
            self._finish_after_backward(loss)

    def _check_weighted_loss(self) -> None:
        """Raise where this strategy cannot normalise a loss by the update's global weight (here: no prepared optimizer,
        whose ``step()`` or ``clip_grad_norm_`` divides the gradient)."""
        if not self._prepared_optimizers():
            raise no_optimizer_to_divide(type(self).__name__)

    def _finish_loss_weights(self, when: str = "step") -> None:
        """At an update step (``when``: as its backward ends ``"backward"``, in ``clip_grad_norm_`` ``"clip"``, as the
        optimizer steps ``"step"``): divide the gradients by the update's global weight (``UpdateWeights.finish``)."""
        self._loss_weights.finish(prepared_parameters(self._prepared_optimizers()), lambda total: self.reduce("sum", total),
                                  when=when, replicas_summed=self.num_replicas_in_sync if self._sums_replica_gradients else 1)

    @property
    def _sums_replica_gradients(self) -> bool:
        """True where an update is the SUM of the replicas' gradients (one device's only for normalised losses)."""
        return True

    def _finish_after_backward(self, loss: torch.Tensor) -> None:
        """Divide the update's gradients by its global weight as the backward through ``loss`` ends (after DDP's and
        FSDP's gradient all-reduce / reduce-scatter: ``p.grad`` is final when backward returns)."""
        after_backward(loss, lambda: self._finish_loss_weights("backward"))

    # --- state and checkpoints (the format is towers.checkpoint's) -------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Return ``{"model", "optimizer", "precision"}``: the training state of a prepared model and optimizer.

        The model's is the user's module's ``state_dict()`` (full tensors, or this process's shards
        as DTensors under a sharded strategy); the optimizer's is keyed by parameter NAME, not by
        torch's position, so it loads under any strategy. Plain tensors, numbers, strings, lists and
        dicts only. A collective where the state lives elsewhere (shards): every replica calls it.

        Args:
            model: the prepared model.
            optimizer: its prepared optimizer (None: the model's state alone).

        Returns:
            ``{"model": ..., "optimizer": ..., "precision": ...}``.
        """
        return {**plain_state_dict(self.unwrap(model), optimizer), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Restore what ``state_dict`` returned (under this or another strategy) into a prepared model and optimizer.

        Every replica calls it. The optimizer loads first: torch checks its state before changing anything.

        Args:
            state: what ``state_dict`` returned.
            model: the prepared model.
            optimizer: its prepared optimizer (None: the model alone).
        """
        load_plain_state_dict(state, self.unwrap(model), optimizer)
        self.precision.load_state_dict(state.get("precision") or {})

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """Return the user's module's full (unsharded) ``state_dict()``; a collective where it is sharded.

        Args:
            model: the prepared model.

        Returns:
            Whole tensors by parameter and buffer name.
        """
        return self.unwrap(model).state_dict()

    def at_preemption_boundary(self) -> bool:
        """Return True where a preemption checkpoint can be taken at this step boundary (every boundary, by default).

        Under DiLoCo on the parameter servers only a boundary right after an outer step can: inside a window each
        worker holds a model of its own. Every process gives the same answer at the same step.

        Returns:
            Whether ``BackupAndRestore`` and ``CheckpointManager.save_if_preempted`` may save here on a notice.
        """
        return True

    def checkpoint_io(self) -> CheckpointIO:
        """How this strategy's processes write checkpoint tensors (every process its part, by default).

        Returns:
            The ``CheckpointIO`` this strategy's checkpoints are written with.
        """
        return self.__dict__.setdefault("_checkpoint_io", CheckpointIO(collective=True))

    def export_model(self, model: nn.Module, path: str | os.PathLike[str]) -> Any:
        """Write the user's module's full weights to ``path`` for inference (safetensors or a torch file); every replica
        calls it. ``towers.checkpoint.export_model(model, path, strategy=self)``; returns the path.

        Args:
            model: the prepared model.
            path: the file (``.safetensors``, or ``.pt``).

        Returns:
            The path.
        """
        return checkpoint.export_model(model, path, strategy=self)

    def save_checkpoint(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> str:
        """Write ``state`` (your dict: model, optimizer, data, values) as a checkpoint at ``path``; every replica calls
        it. ``towers.checkpoint.save_checkpoint(path, state, strategy=self)``; any strategy restores it.

        Args:
            path: the checkpoint's folder.
            state: your dict: model, optimizer, data, values.

        Returns:
            The path.
        """
        return str(checkpoint.save_checkpoint(path, state, strategy=self))

    def restore_checkpoint(self, path: str | os.PathLike[str], objects: Mapping[str, Any]) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``objects`` (``{"model": model, ...}``) and return all it holds.
        ``towers.checkpoint.restore_checkpoint(path, objects, strategy=self)``.

        Args:
            path: the checkpoint's folder.
            objects: keys of the saved dict -> live objects to load into (``{"model": model, ...}``).

        Returns:
            Everything the checkpoint holds.
        """
        return checkpoint.restore_checkpoint(path, objects, strategy=self)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Return the dict saved at ``path`` (tensors whole, on the CPU); every replica reads it.

        Args:
            path: the checkpoint's folder.

        Returns:
            The dict as saved.
        """
        return checkpoint.load_checkpoint(path, strategy=self)

    def checkpoint_exists(self, path: str | os.PathLike[str]) -> bool:
        """Return True when a complete checkpoint is published at ``path``.

        Args:
            path: the checkpoint's folder.

        Returns:
            False when nothing, or a checkpoint still being written, is there.
        """
        return checkpoint.checkpoint_exists(path)

    def delete_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` and everything it holds; call it on the chief (nothing if absent).

        Args:
            path: the checkpoint's folder.
        """
        checkpoint.delete_checkpoint(path)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint in flight (if any) is written and visible at its path."""
        self.checkpoint_io().wait(is_chief=self.is_chief, broadcast_object=self.broadcast_object)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(replica {self.replica_id}/{self.num_replicas_in_sync}, "
                f"device={self.device})")

