"""What the synchronous strategies (OneDevice, Mirrored, MultiWorkerMirrored, sharded) share.

A replica computes on one device; ``comm`` says how it talks to the others (``LocalComm`` for
one replica, ``ProcessGroupComm`` over torch.distributed). Subclasses decide how ``prepare``
wraps a model (``_wrap_model``) and how gradient synchronisation is switched off on the
non-final micro-batches of an update (``_set_gradient_sync``). Hot path: ``run`` finds the
batch's accounting among its arguments and sets two context variables — no collective of its own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.data import DistributedDataset, DistributedStream, find_batch_info, is_stream
from towers.errors import FailedPreconditionError, InvalidArgumentError, InvalidTypeError, user_error
from towers.parallel.layout import Layout
from towers.parallel.parallelize import ParallelOptions, parallelize
from towers.process_group import collective
from towers.strategies._bitwise import BitwiseSteps
from towers.strategies._bitwise_run import run_micro_batches
from towers.strategies._bitwise_setup import deterministic_kernels
from towers.strategies._collectives import LocalComm, ProcessGroupComm, as_tensor, check_op, named_collective
from towers.strategies._copies import DetachedHook
from towers.strategies._steps import StepTracker, StrategyOptimizer
from towers.strategies.base import ReplicaContext, Strategy, current_replica_context, note_built
from towers.strategies.context import enter_until_next_step
from towers.strategies.precision import MixedPrecisionModule, Precision, resolve_precision

__all__ = ["SyncStrategy"]

log = get_logger(__name__)


class SyncStrategy(Strategy):
    """A synchronous data-parallel strategy: replicas step together on shares of one global batch."""

    def __init__(self, *, info: ProcessInfo, device: torch.device, comm: LocalComm | ProcessGroupComm,
                 precision: "str | int | Precision | None" = "32", gradient_accumulation_steps: int = 1,
                 bitwise: BitwiseSteps | None = None, layout: Layout | None = None):
        self._info = info
        #: The layout when one replica spans several processes (tp or pp): a replica's first process speaks for it
        self._spanning = layout if layout is not None and layout.model_parallel and info.world_size > 1 else None
        #: ``bitwise=True``: the micro-batches and the fixed tree their gradients are summed over (``_bitwise.py``)
        self._bitwise = bitwise
        if bitwise is not None:
            deterministic_kernels(device)
        note_built(info, self.name)
        self._device = device
        self._comm = comm
        self._precision = resolve_precision(precision, device)
        self._tracker = StepTracker(gradient_accumulation_steps)
        self._user_modules: list[nn.Module] = []  # what prepare() received
        self._wrapped: list[nn.Module] = []  # what prepare() returned
        self._optimizers: list[torch.optim.Optimizer] = []

    # --- who am I -------------------------------------------------------------------------------------
    @property
    def process_info(self) -> ProcessInfo:
        return self._info

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_replicas_in_sync(self) -> int:
        return self._comm.num_replicas

    @property
    def replica_id(self) -> int:
        return self._comm.rank

    @property
    def is_chief(self) -> bool:
        if self._spanning is not None:  # one replica spans processes: the job's chief alone, not each of its replica's
            return self._info.rank == self._info.chief_rank
        return self.replica_id == self._info.chief_rank if self._comm.num_replicas > 1 else True

    @property
    def precision(self) -> Precision:
        """The precision object this strategy computes with (``.name``: ``"32"``, ``"bf16"`` or ``"fp16"``)."""
        return self._precision

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer update."""
        return self._tracker.accumulation_steps

    # --- preparation ----------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False, activation_checkpointing: str = "off") -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)``: the model on this replica's device (wrapped for sync) and a stepping-aware optimizer.

        ``compile=True`` (or a dict of ``torch.compile`` options) compiles the wrapped model, after the
        strategy's own wrapping. ``activation_checkpointing`` (``"off"``, ``"block"``, ``"selective"``) makes
        the model's repeated blocks recompute their activations in backward; applied before any wrapping.

        Raises:
            TypeError: when ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
            ValueError: when the model or optimizer was already prepared, or the model differs across replicas; a bad
                ``activation_checkpointing``, or one other than ``"off"`` for a model without repeated blocks.
            RuntimeError: ``compile`` with inductor on a CPU without a C++ compiler.
        """
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(f"prepare expects an nn.Module as model. Received: {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTypeError(
                f"prepare expects a torch.optim.Optimizer (or None) as optimizer. Received: {type(optimizer).__name__}.")
        if any(model is m for m in (*self._user_modules, *self._wrapped)):
            raise InvalidArgumentError(
                f"This {type(model).__name__} was already prepared by this strategy. Call prepare once per model "
                "and keep using the model it returned.")
        if isinstance(optimizer, StrategyOptimizer) or any(optimizer is o for o in self._optimizers):
            raise user_error("This optimizer was already prepared by this strategy", type(optimizer).__name__,
                             "Call prepare once per optimizer and keep using the optimizer it returned.")
        if optimizer is not None and self._precision.needs_loss_scaling and self._optimizers:
            raise user_error("precision='fp16' supports one optimizer per strategy (one loss scale)",
                             f"a second optimizer ({type(optimizer).__name__})",
                             "Use precision='bf16' for several optimizers, or put every parameter group in one optimizer.")
        model = model.to(self._device)
        wrapped = self._parallelize(model, activation_checkpointing)
        if self._bitwise is not None:
            self._watch_bitwise(self._bitwise, model)
        # A plain loop (no strategy.run) still trains one device's maths: the forward's batch starts the step.
        # Detached: a copy of the model (AveragedModel, deepcopy, pickle) is not prepared and copies no strategy.
        wrapped.register_forward_pre_hook(DetachedHook(self._step_outside_run), with_kwargs=True)
        check = self._before_step_check(wrapped) if optimizer is not None else None
        wrapped = self._compile(wrapped, compile)
        self._user_modules.append(model)
        self._wrapped.append(wrapped)
        if optimizer is None:
            return wrapped, None
        self._optimizers.append(optimizer)
        multi = self._comm.num_replicas > 1
        wrapper = StrategyOptimizer(optimizer, self._tracker, self._precision,
                                    all_reduce_max=self._comm.all_reduce_max_ if multi else None,
                                    before_step=check, finish_gradients=self._finish_loss_weights)
        return wrapped, wrapper

    def _step_outside_run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before a prepared model's forward outside ``strategy.run``: the batch it is given starts the step.

        A loop written for one device (``for x, y in loader: loss = ...(model(x)); loss.backward()``) has no
        ``strategy.run``; when ``x`` came from ``distribute_dataset`` its accounting is read here, as ``run``
        would read it, and stays the current step's until the next forward: ``compute_average_loss`` then
        knows the global batch, and accumulation windows and gradient sync follow the batch. Nothing
        happens inside ``run``, under ``torch.no_grad()`` (an evaluation pass), or on a batch without accounting.
        """
        context = current_replica_context()
        if (context is not None and not context.until_next_step) or not torch.is_grad_enabled():
            return  # inside a strategy.run (the step is the run's), or an evaluation
        if self._bitwise is not None:
            raise user_error("bitwise=True runs each step through strategy.run, which cuts the batch into its "
                             "micro-batches", "a forward of the prepared model outside strategy.run",
                             "Write the step as a function and call strategy.run(train_step, args=(x, y)).")
        info = find_batch_info(args, kwargs)
        if info is None:
            return
        self._own_random_stream()
        run = self._tracker.begin_run(info)
        self._set_gradient_sync(run.sync)  # off on a non-final micro-batch, on again at the update's last one
        implicit = ReplicaContext(
            self, global_batch_size=run.global_batch_size, num_padding_examples=run.num_padding_examples,
            accumulation_steps=run.accumulation_steps, is_update_step=run.sync, until_next_step=True)
        enter_until_next_step(self, implicit)

    def _updates_now(self) -> bool:
        context = current_replica_context()  # outside run: the last run's place in its accumulation window
        return context.is_update_step if context is not None else self._tracker.sync

    def _prepared_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._optimizers)

    def _parallelize(self, model: nn.Module, activation_checkpointing: str) -> nn.Module:
        """Return ``model`` laid out for this strategy by ``towers.parallel.parallelize`` (one replica per process:
        activation checkpointing, then ``_wrap_model``)."""
        return parallelize(model, None, ParallelOptions(activation_checkpointing=activation_checkpointing),
                           wrap=self._wrap_model)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """Return ``model`` ready for a step (one replica: only the precision wrapper, when enabled)."""
        if self._precision.enabled:
            return MixedPrecisionModule(model, self._precision)
        return model

    def _watch_bitwise(self, bitwise: BitwiseSteps, model: nn.Module) -> None:
        """``bitwise=True``: collect each micro-batch's gradient at the end of its backward (a strategy that reduces
        gradients in a collective of its own sums the tree there instead)."""
        bitwise.watch(model)

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Switch gradient synchronisation of the prepared models on or off (nothing to switch on one replica)."""

    def _before_step_check(self, wrapped: nn.Module) -> Callable[[], None] | None:
        """Return a check the optimizer runs before each real update (None: nothing to check)."""
        return None

    def distribute_dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                           drop_remainder: bool = False, pad_empty_batches: bool = False,
                           collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                           prefetch_factor: int | None = None, persistent_workers: bool = False,
                           pin_memory: bool | None = None,
                           **stream_options: Any) -> DistributedDataset | DistributedStream:
        """Return this replica's share of each global batch of ``dataset``, on its device (see ``towers.data``).

        A stream (``towers.data.Shards``, a torch ``IterableDataset``, a Hugging Face streaming
        dataset) gives a ``DistributedStream``; ``stream_options`` (``num_virtual_shards``,
        ``shuffle_block``) go to it. Anything else gives a ``DistributedDataset``.
        ``num_workers > 0`` makes this replica's batches on that many ``DataLoader`` worker
        processes (``prefetch_factor``, ``persistent_workers``, ``pin_memory``: None pins for CUDA),
        with the same batches, order and resume position as ``num_workers=0``.

        Raises:
            ValueError: when ``global_batch_size`` is not positive or smaller than the replicas, the
                dataset has fewer examples than replicas, or ``num_workers`` is not an integer >= 0.
            TypeError: when ``dataset`` is neither map-style nor a stream, or a stream option is unknown.
        """
        layout: dict[str, Any] = dict(
            num_replicas=self.num_replicas_in_sync, replica_id=self.replica_id, device=self._device, shuffle=shuffle,
            seed=seed, drop_remainder=drop_remainder, pad_empty_batches=pad_empty_batches,
            accumulation_steps=self._tracker.accumulation_steps, collate_fn=collate_fn, num_workers=num_workers,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, pin_memory=pin_memory)
        if self._bitwise is not None:  # shares of whole micro-batches; the micro-batch must divide the global batch
            self._bitwise.check_batch_size(global_batch_size)
            layout["split_unit"] = self._bitwise.micro_batch_size
        if is_stream(dataset):
            agree = self._max_over_replicas if self.num_replicas_in_sync > 1 else None
            return DistributedStream(dataset, global_batch_size, **layout, agree=agree, **stream_options)
        if stream_options:
            raise user_error("num_virtual_shards and shuffle_block apply to streams only", sorted(stream_options),
                             "Leave them out for a map-style dataset.", cls=TypeError)
        return DistributedDataset(dataset, global_batch_size, **layout)

    def _max_over_replicas(self, operation: str, value: torch.Tensor) -> torch.Tensor:
        """Return the element-wise max of ``value`` over the replicas: a stream's file check before an epoch."""
        with named_collective(operation, "Iterate a distributed stream on every replica, at the same point of the "
                                         "loop: each iteration starts by comparing the replicas' files."):
            return self.reduce("max", value)

    # --- steps ----------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this replica's step and return its result.

        The step's global batch size, padding and accumulation window come from the batch in
        ``args``/``kwargs`` as ``distribute_dataset`` yielded it.

        Raises:
            RuntimeError: when no model was prepared with ``strategy.prepare``.
            ValueError: when the arguments mix tensors of different batches.
        """
        if not self._wrapped:
            raise FailedPreconditionError(
                f"strategy.run was called before any model was prepared. Expected `model, optimizer = "
                f"strategy.prepare(model, optimizer)` first (under {type(self).__name__} gradients are only "
                "combined across replicas for prepared models); then call the returned model inside the step.")
        kwargs = dict(kwargs or {})
        self._own_random_stream()
        run = self._tracker.begin_run(find_batch_info(args, kwargs))
        if self._bitwise is not None:
            return self._run_bitwise(self._bitwise, run, fn, tuple(args), kwargs)
        self._comm.note_run(run.batch)  # a user's own loader: steps counted, checked at the next collective
        context = ReplicaContext(self, global_batch_size=run.global_batch_size,
                                 num_padding_examples=run.num_padding_examples,
                                 accumulation_steps=run.accumulation_steps, is_update_step=run.sync)
        try:
            if not run.sync:  # accumulate locally: no gradient all-reduce on this micro-batch
                self._set_gradient_sync(False)
            with self._entered(context):
                return fn(*args, **kwargs)
        except Exception as exc:
            batch = run.batch
            if batch is None or batch.local_batch_size or batch.num_padding_examples:
                raise
            raise FailedPreconditionError(
                f"Replica {self.replica_id} got an empty share of global batch {batch.index} ({batch.global_batch_size} "
                f"example(s) over {self.num_replicas_in_sync} replicas) and the step failed on it: "
                f"{type(exc).__name__}: {exc}. Expected the model to accept a batch of 0 examples; otherwise use "
                "strategy.distribute_dataset(..., pad_empty_batches=True) (one zero-weight example instead) or "
                "drop_remainder=True.") from exc
        finally:
            if not run.sync:
                self._set_gradient_sync(True)

    # --- communication --------------------------------------------------------------------------------
    def _run_bitwise(self, bitwise: BitwiseSteps, run: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
        """``run`` under ``bitwise=True``: ``fn`` once per micro-batch of this replica's share (``run_micro_batches``),
        their gradients summed over the tree at the end of the last one's backward; the optimizer steps after it."""

        def step_context(last: bool, leaf: int | None, count: int) -> contextlib.AbstractContextManager[None]:
            self._tracker.sync = run.sync and last  # the optimizer steps after the last micro-batch only
            return self._entered(ReplicaContext(
                self, global_batch_size=run.global_batch_size, accumulation_steps=run.accumulation_steps * count,
                gradient_shares=-(-run.global_batch_size // bitwise.micro_batch_size),  # the update's micro-batches
                num_padding_examples=run.num_padding_examples if leaf is None else 0, is_update_step=run.sync and last))

        return run_micro_batches(bitwise, run.batch, fn, args, kwargs, replica_id=self.replica_id, device=self._device,
                                 step_context=step_context)

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` across replicas (see ``Strategy.reduce``); ``axis`` also reduces over that axis, ragged-aware.

        Raises:
            ValueError: on an unknown op or an axis the value does not have.
            TypeError: when ``value`` is not a tensor or a number.
        """
        op = check_op(op)
        tree = None if self._bitwise is None else self._bitwise.reduce(op, value)
        if tree is not None:
            return tree  # the step's losses over the tree: the same bits at any replica count
        tensor = as_tensor(value, self._device)
        if axis is not None and not -tensor.dim() <= axis < max(tensor.dim(), 1):
            raise InvalidArgumentError(
                f"axis must be None or a dimension of the value (shape {list(tensor.shape)}). Received: axis={axis}. "
                "Use axis=0 to reduce over the batch.")
        if axis is not None and tensor.dim() == 0:
            raise InvalidArgumentError("axis must be None for a scalar value. Received: axis=0 with a 0-d tensor.")
        if axis is not None and axis < 0:
            axis += tensor.dim()
        return self._comm.reduce(op, tensor, axis)

    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every replica's ``value`` along ``axis`` (ragged sizes allowed), in replica order."""
        tensor = as_tensor(value, self._device)
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        return self._comm.gather(tensor, axis if axis >= 0 else axis + tensor.dim())

    def barrier(self) -> None:
        """Block until every replica reaches this point (bounded by ``timeout_s``)."""
        self._comm.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return replica ``src``'s ``obj`` on every replica (a replica of several processes: from its first process to
        every process of the job, whose checkpoint writes take part together)."""
        if self._spanning is None:
            return self._comm.broadcast_object(obj, src)
        import torch.distributed as dist

        first = src * self._spanning.tp  # replica src's process at pp 0 and tp 0
        with collective("strategy.broadcast_object"):
            box = [obj if self._info.rank == first else None]
            dist.broadcast_object_list(box, src=first)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every replica's ``obj``, in replica order."""
        return self._comm.all_gather_object(obj)
