"""``ParameterServerStrategy``: ps tasks hold the parameters; workers compute gradients, push them, pull fresh values.

Roles: the last ``num_ps`` ranks of the job are the ps tasks (``ps:0`` .. ``ps:K-1``), ranks ``0 .. W-1`` are the
workers and replicas (worker 0 is the chief). This is the order of ``towers.cluster`` for both ``towers launch
--num-ps K`` and TF_CONFIG (chief, workers, ps).

On a ps task the constructor serves until every worker is done, then exits the process with code 0 (like TF's
``server.join()``), so the rest of the training script runs only on workers. ``exit_on_ps=False`` returns instead
(tests, notebooks): check ``strategy.is_ps``.

A preemption notice (SIGTERM, SIGUSR1, ``TOWERS_PREEMPTION_SIGNALS``) to a ps task does not end it: the parameters and
embedding rows the workers checkpoint live here. It tells the workers through the job's store, serves while they agree
on a step and save, and then exits with ``PREEMPTED_EXIT_CODE`` (75), as they do (``towers.checkpoint.preemption``).
Under ``mode="diloco"`` the workers save only right after an outer step (``at_preemption_boundary``), with the outer
optimizer's state from the ps tasks and each worker's inner state (``diloco_state.py``), so a resumed job goes on exactly.

Collectives (``reduce``, ``gather``, ``barrier``, ``*_object``) meet at ps task 0, not among the workers, so they keep
working after a worker dies: they then combine the values of the live workers only. ``distribute_dataset`` gets its
batches from ps task 0 one at a time, so the others take over a dead worker's share (``dispatch.py``).
"""

from __future__ import annotations

import atexit
import sys
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from towers._logging import get_logger, set_rank
from towers.checkpoint.layout import CheckpointIO
from towers.checkpoint.preemption import Preempted
from towers.cluster.info import ProcessInfo
from towers.cluster.strategy_options import parse_flag
from towers.data import BatchInfo, Dispatch, DistributedDataset, DistributedStream
from towers.devices import gpu_count, warn_if_gpus_idle
from towers.errors import FailedPreconditionError, UnimplementedError
from towers.parallel.parallelize import ParallelOptions, parallelize
from towers.process_group import DEFAULT_TIMEOUT_S, destroy_process_group
from towers.strategies._loss_weights import prepared_parameters
from towers.strategies.base import ReplicaContext, Strategy, note_built
from towers.strategies.parameter_server import transport
from towers.strategies.parameter_server.bitwise import BitwisePushes
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.collectives import WorkerCollectives
from towers.strategies.parameter_server.diloco import DiLoCo
from towers.strategies.parameter_server.diloco_options import diloco_options
from towers.strategies.parameter_server.diloco_state import load_outer_state, split_diloco_state, with_diloco_state
from towers.strategies.parameter_server.embeddings import SparseTables, bind_tables
from towers.strategies.parameter_server.generations import ModelGenerations
from towers.strategies.parameter_server.inputs import worker_input
from towers.strategies.parameter_server.optimizer import prepared_optimizer
from towers.strategies.parameter_server.options import MODES, check_options, refuse_loss_scaling
from towers.strategies.parameter_server.roles import Roles, resolve_roles
from towers.strategies.parameter_server.startup import open_links, serve_links
from towers.strategies.parameter_server.traffic import wire_stats
from towers.strategies.parameter_server.worker import BoundModel
from towers.strategies.precision import MixedPrecisionModule, Precision, resolve_precision

__all__ = ["ParameterServerStrategy", "MODES"]

log = get_logger(__name__)


class ParameterServerStrategy(Strategy):
    """Parameters on ``num_ps`` ps tasks, gradients from every worker, ``async`` or ``sync`` updates.

    Args:
        num_ps: ps tasks; default: what the launcher asked for (``--num-ps``, TF_CONFIG), else 1.
        mode: ``"async"`` (apply each gradient on arrival), ``"sync"`` (one summed update per round) or ``"diloco"``
            (``sync_every`` steps on each worker alone, then an outer step on the ps tasks: slow links; ``diloco.py``).
        staleness: ``async`` only: a push waits while its worker has more than ``staleness`` applied
            updates beyond the slowest live worker. ``None``: no bound.
        info: this process's place in the job (default ``towers.cluster.from_env()``).
        timeout_s: bound on every wait (connecting, a round, a gather, a staleness wait, a reply).
        exit_on_ps: on a ps task, ``sys.exit(0)`` after serving (default); False returns instead.
        precision: ``"32"`` or ``"bf16"`` (the workers' forward under autocast). ``"fp16"`` is refused:
            its loss scale must move in lockstep on every replica, which async updates do not have.
        overlap: ``async`` only: a worker reads its push's reply (the updated parameters) during its next
            step, so the ps tasks apply the update while the worker computes: faster, at the cost of one
            more step of staleness (the next gradient is taken before this update is in). Default False.
        shared_memory: a worker and a ps task on the same host exchange the dense gradients and parameters
            through shared memory (``/dev/shm``), and their link carries only the message headers. Hosts
            apart, or a ps task that refuses, keep the wire. Not used with ``overlap=True``. Default True.
        sync_every: DiLoCo's inner steps between outer steps (this and the six below: ``mode="diloco"`` only; None: default).
        outer_optimizer: DiLoCo's, on the ps tasks: ``"nesterov"``, ``"sgd"`` or a callable ``params -> Optimizer``.
        outer_lr: the named outer optimizer's learning rate.
        outer_momentum: the named outer optimizer's momentum.
        outer_mode: ``"sync"`` (one outer step per round of every live worker's change) or ``"async"`` (on arrival).
        compression: how a DiLoCo change travels: ``float32``, ``bf16``, ``int8`` or ``int4`` (with error feedback).
        fragments: DiLoCo syncs the parameters in this many parts, one per outer step (``diloco_options.py``).

    Raises:
        ValueError: unknown mode, bad staleness or DiLoCo option, ``num_ps`` that leaves no worker or contradicts the
            launcher, precision ``"fp16"``.
        DistributedError: connecting failed, or (on a ps task) the job failed while serving.
    """

    name = "ps"
    #: Hand batches out one at a time from ps task 0, so survivors take over a dead worker's share.
    _dispatch_batches = True

    def __init__(self, num_ps: int | None = None, mode: str = "async", staleness: int | None = None, *,
                 info: ProcessInfo | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, exit_on_ps: bool = True,
                 precision: str | int | None = "32", overlap: bool = False, shared_memory: bool = True,
                 bitwise: bool = False, micro_batch_size: int | None = None, sync_every: int | None = None,
                 outer_optimizer: Any = None,
                 outer_lr: float | None = None, outer_momentum: float | None = None, outer_mode: str | None = None,
                 compression: str | None = None, fragments: int | None = None):
        overlap, shared_memory = parse_flag("overlap", overlap), parse_flag("shared_memory", shared_memory)
        check_options(mode, staleness, timeout_s=timeout_s, overlap=overlap, shared_memory=shared_memory)
        build = BitwisePushes.check(bitwise, micro_batch_size, mode=mode,
                                    precision=str(precision) if precision is not None else "32")
        outer = diloco_options(mode, staleness, overlap=overlap, strategy=self.name, options=dict(
            sync_every=sync_every, outer_optimizer=outer_optimizer, outer_lr=outer_lr, outer_momentum=outer_momentum,
            outer_mode=outer_mode, compression=compression, fragments=fragments))
        self.overlap, self.shared_memory, exit_on_ps = overlap, shared_memory, parse_flag("exit_on_ps", exit_on_ps)
        if info is None:
            from towers import cluster

            info = cluster.from_env()
        self._info, self.mode, self.staleness, self.timeout_s = info, mode, staleness, timeout_s
        note_built(info, self.name)
        self.roles: Roles = resolve_roles(info, num_ps)
        self.num_ps = self.roles.num_ps
        self._diloco = DiLoCo(outer, num_workers=self.roles.num_workers) if outer is not None else None
        self._client: ParameterClient | None = None
        self._bound: BoundModel | None = None
        self._sparse: SparseTables | None = None
        self._prepared_any = False
        self._generations = ModelGenerations()
        self._optimizer: torch.optim.Optimizer | None = None
        self._stats: dict[str, Any] | None = None
        self._datasets = 0  # distribute_dataset calls: names each dataset's passes the same on every worker
        self._empty_step = False  # the last step's batch had no example
        self._ran_units: list[list[Any]] = []  # dispatched batches run since the last push: [pass, g, r]
        self._device = self._replica_device()
        self._precision = resolve_precision(precision, self._device)
        refuse_loss_scaling(self._precision)
        set_rank(info.rank, info.world_size)
        links = open_links(self.roles, info, timeout_s=timeout_s, before_links=self._before_links)
        if self.roles.is_ps:
            self._serve(links, exit_on_ps)
        else:
            self._client = ParameterClient(links, worker=self.roles.index, rank=info.rank,
                                           world_size=info.world_size, ps_ranks=self.roles.ps_ranks,
                                           timeout_s=timeout_s)
            # ps tasks are the last ranks, so on a single host the workers are the first local ranks
            local_workers = min(info.local_world_size, self.roles.num_workers)
            warn_if_gpus_idle(local_workers, [self.device], local_rank=info.local_rank)
            atexit.register(self.shutdown)
            log.info("parameter servers: %d ps task(s) at ranks %s, %d worker(s), mode %s%s", self.num_ps,
                     self.roles.ps_ranks, self.roles.num_workers, mode,
                     f", staleness {staleness}" if staleness is not None else "")
        self._collectives = WorkerCollectives(self.roles, info, self._client, self.device)  # met at ps task 0
        #: ``bitwise=True``: steps micro-batch by micro-batch, pushes of subtrees summed at the ps over the tree
        self._bitwise = self._bitwise_steps(build) if build is not None and not self.roles.is_ps else None

    def _bitwise_steps(self, build: Callable[..., Any]) -> BitwisePushes:
        """What runs this worker's steps under ``bitwise=True``: pushes of subtrees, summed at the ps tasks."""
        return BitwisePushes(self, build)

    def _before_links(self) -> None:
        """Hook: collectives every rank (ps tasks too) must join before the ps tasks start serving."""

    def _serve(self, links: list[transport.Link], exit_on_ps: bool) -> None:
        mode = self._diloco.options.outer_mode if self._diloco is not None else self.mode  # DiLoCo: rounds of changes
        self._stats, preempted_at = serve_links(links, self.roles, self._info, mode=mode, staleness=self.staleness,
                                                timeout_s=self.timeout_s, shared_memory=self.shared_memory,
                                                exit_on_ps=exit_on_ps)
        if exit_on_ps:
            destroy_process_group()
            if preempted_at is not None:
                raise Preempted(preempted_at)
            sys.exit(0)

    # --- who am I ------------------------------------------------------------------------------------
    @property
    def process_info(self) -> ProcessInfo:
        """This process's place in the job."""
        return self._info

    @property
    def is_ps(self) -> bool:
        """True on a ps task (only seen with ``exit_on_ps=False``)."""
        return self.roles.is_ps

    def _replica_device(self) -> torch.device:
        # ps tasks keep parameters on the CPU; worker i computes on cuda:<local rank> when the host has it.
        if not self.roles.is_ps and gpu_count() > self._info.local_rank:
            return torch.device("cuda", self._info.local_rank)
        return torch.device("cpu")

    @property
    def device(self) -> torch.device:
        """CPU, or ``cuda:<local_rank>`` on a worker of a host with a GPU per local process."""
        return self._device

    @property
    def precision(self) -> Precision:
        """The workers' precision object (``"32"`` or ``"bf16"``)."""
        return self._precision

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of workers: the global batch is split across them."""
        return self.roles.num_workers

    @property
    def replica_id(self) -> int:
        """This worker's index (the chief is 0); -1 on a ps task."""
        return -1 if self.roles.is_ps else self.roles.index

    # --- collectives: met at ps task 0, over the live workers (WorkerCollectives) ----------------------
    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` over the workers with ``op``; after a worker died: over the live ones.

        Raises:
            ValueError: on an unknown op or an axis the value does not have.
        """
        tree = self._bitwise.steps.reduce(op, value) if self._bitwise is not None else None  # bitwise: the losses' tree
        return tree if tree is not None else self._collectives.reduce(op, value, axis)

    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every live worker's ``value`` along ``axis``, in worker order."""
        return self._collectives.gather(value, axis)

    def barrier(self) -> None:
        """Block until every live worker reaches this point (a round trip to ps task 0)."""
        self._collectives.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return worker ``src``'s ``obj`` on every worker."""
        return self._collectives.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every live worker's ``obj``, in worker order."""
        return self._collectives.all_gather_object(obj)

    def _require_worker(self, what: str) -> ParameterClient:
        """This worker's client to the ps tasks; on a ps task, an error saying that ``what`` runs on workers."""
        return self._collectives.require_worker(what)

    # --- preparation -------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False, activation_checkpointing: str = "off") -> tuple[nn.Module, Any]:
        """Register ``model`` with the ps tasks; return it (now holding the ps values) and a pushing optimizer.

        The chief's parameter values become the starting values everywhere.

        Raises:
            ValueError: this worker's model differs from the chief's, or the optimizer holds foreign tensors.
            DistributedError: a ps task is gone or silent.
        """
        client = self._require_worker("prepare")
        generation = self._generations.of(model)  # a later model replaces the earlier one on the ps tasks
        if generation > 0:
            client.finish()  # the reply of the earlier model's last push (overlap) lands before the ps moves on
        model = parallelize(model.to(self.device), None, ParallelOptions(activation_checkpointing=activation_checkpointing))
        sparse = self._bind_tables(model, optimizer, client, generation)
        if self._bitwise is not None:
            self._bitwise.refuse_tables(sparse is not None)
        diloco = self._diloco.check_model(sparse, optimizer) if self._diloco is not None else None
        bound = None
        if sparse is None or any(True for _ in model.parameters()):
            bound = BoundModel(model, client, num_ps=self.num_ps, is_chief=self.is_chief, overlap=self.overlap,
                               optimizer=optimizer if diloco is None else diloco.outer_optimizer(model),
                               shared_memory=self.shared_memory and diloco is None and self._bitwise is None,
                               on_dead=self._log_dead, generation=generation)
            if self._bitwise is not None:
                self._bitwise.watch(model, bound)  # before register: the ps keeps torch's kernel choice
            bound.register()
            bound.install_hooks(refresh_on_state_dict=self.mode == "async")
            self._bound = bound
        self._generations.prepared(model)
        prepared = MixedPrecisionModule(model, self._precision) if self._precision.enabled else model
        prepared = self._compile(prepared, compile)
        self._optimizer = optimizer
        self._prepared_any = True
        return prepared, prepared_optimizer(self, optimizer, bound, sparse, diloco=diloco, generation=generation)

    def _bind_tables(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     client: ParameterClient, generation: int) -> SparseTables | None:
        """Connect the model's ``ShardedEmbedding`` tables to the ps tasks; None when it has none."""
        sparse = bind_tables(model, optimizer, client, num_ps=self.num_ps, generation=generation)
        self._sparse = sparse if sparse is not None else self._sparse
        return sparse

    def _take_step_batches(self) -> tuple[bool, list[list[Any]]]:
        """Whether the last step's batch was empty, and the dispatched batches run since the last push; forgets both."""
        empty, units = self._empty_step, self._ran_units
        self._empty_step, self._ran_units = False, []
        return empty, units

    def _prepared_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self._optimizer] if self._optimizer is not None else []

    def _check_weighted_loss(self) -> None:
        super()._check_weighted_loss()
        for refuser in (self._diloco, self._sparse):  # DiLoCo's inner steps, the rows' gradients: normalised apart
            if refuser is not None:
                refuser.refuse_weighted_loss()

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this worker's step (see ``Strategy.run``).

        Raises:
            RuntimeError: on a ps task, or when no model was prepared with ``strategy.prepare``.
        """
        self._require_worker("run")
        if not self._prepared_any:
            raise FailedPreconditionError(
                "strategy.run was called before any model was prepared. Expected `model, optimizer = "
                "strategy.prepare(model, optimizer)` first: under ParameterServerStrategy only a prepared model "
                "trains the parameters the ps tasks hold (otherwise every worker would train a model of its own); "
                "then call the returned model and optimizer inside the step.")
        if self._bitwise is not None:
            return self._bitwise.run(fn, tuple(args), dict(kwargs or {}))
        return super().run(fn, args, kwargs)

    def _replica_context(self, batch: BatchInfo | None) -> ReplicaContext:
        # The step's batch, as run found it: the next push names its unit and masks an empty one.
        self._empty_step = batch is not None and batch.local_batch_size == 0
        if batch is not None and batch.unit is not None:
            self._ran_units.append(list(batch.unit))
        if self._diloco is not None:
            self._diloco.note_batch(batch)
        return super()._replica_context(batch)

    @property
    def _sums_replica_gradients(self) -> bool:
        # A sync round sums the workers' pushes; an async push is applied alone (TF's per-worker steps).
        return self.mode == "sync"

    def _finish_loss_weights(self, when: str = "step") -> None:
        if self._bitwise is None or not self._bitwise.pushes:
            return super()._finish_loss_weights(when)
        # bitwise pushes: p.grad here is the share; the ps divides the tree's sum by the update's weight as one device
        self._loss_weights.finish(prepared_parameters(self._prepared_optimizers()), self._bitwise.divisor(self.reduce),
                                  when=when, replicas_summed=self.num_replicas_in_sync)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Not available under parameter servers: raises ``NotImplementedError`` naming the alternatives."""
        raise UnimplementedError(
            f"ParameterServerStrategy cannot clip gradients by their global norm (max_norm={max_norm}): each worker "
            "holds only its share of the gradient until the ps tasks add them up. Clip inside the model (e.g. "
            "clamp activations), lower the learning rate, or use MirroredStrategy, where every replica holds the "
            "summed gradient.")

    def _log_dead(self, count: int) -> None:
        if self.is_chief and self._client is not None:
            stats = self._client.stats()[0]
            for w, reason in sorted(stats["dead"].items()):
                log.warning("worker %d (rank %d) is gone (%s); the other workers go on and take over its batches", w, w, reason)

    def distribute_dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                           drop_remainder: bool = False, pad_empty_batches: bool = False,
                           collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                           prefetch_factor: int | None = None, persistent_workers: bool = False,
                           pin_memory: bool | None = None,
                           **stream_options: Any) -> DistributedDataset | DistributedStream:
        """Return this worker's share of each global batch of ``dataset`` (workers are the replicas; see ``towers.data``).

        The batches come from ps task 0 one at a time: a worker's own share first, then the share of
        a worker that died, so every example of a pass is used although a worker is gone. Those are
        fetched in the training process: ``num_workers > 0`` is refused here; ``HybridStrategy``
        (static shares) takes loader workers like ``MirroredStrategy``. Streams (``towers.data.Shards``,
        an ``IterableDataset``) give a ``DistributedStream`` (``stream_options``: ``num_virtual_shards``,
        ``shuffle_block``); handed out by ps task 0 too, after it is counted once (its records read,
        none transformed): a dead worker's share of a stream is trained by the others as well.

        Raises:
            TypeError: a stream option for a map-style dataset.
        """
        client = self._require_worker("distribute_dataset")
        self._datasets += 1
        fetch = client.next_batches if self._diloco is None else self._diloco.dispatch(client)
        dispatch = Dispatch(f"d{self._datasets}", fetch) if self._dispatch_batches else None
        if self._bitwise is not None:  # shares of whole micro-batches; the micro-batch must divide the global batch
            self._bitwise.steps.check_batch_size(global_batch_size)
        return worker_input(dataset, global_batch_size, num_replicas=self.num_replicas_in_sync, replica_id=self.replica_id,
                            device=self.device, dispatch=dispatch, stream_options=stream_options, shuffle=shuffle, seed=seed,
                            drop_remainder=drop_remainder, pad_empty_batches=pad_empty_batches, collate_fn=collate_fn,
                            num_workers=num_workers, prefetch_factor=prefetch_factor,
                            persistent_workers=persistent_workers, pin_memory=pin_memory,
                            split_unit=1 if self._bitwise is None else self._bitwise.steps.micro_batch_size)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Return ``{"model", "optimizer", "precision"}`` (``Strategy.state_dict``); every worker calls it.

        Under ``mode="diloco"`` the optimizer's entry also holds the outer optimizer's state, fetched from the
        ps tasks, and every worker's inner optimizer state (``diloco_state.py``).
        """
        if self._diloco is None:
            return super().state_dict(model, optimizer)
        self._diloco.settle()  # overlap: the outer push's reply lands first, so the model saved is the global one
        return with_diloco_state(super().state_dict(model, optimizer), model=self.unwrap(model), optimizer=optimizer,
                                 gather=self.all_gather_object)

    def load_state_dict(self, state: Mapping[str, Any], model: nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Restore what ``state_dict`` returned (``Strategy.load_state_dict``); DiLoCo's outer state goes to the ps tasks."""
        state, outer = split_diloco_state(state, self.replica_id)
        super().load_state_dict(state, model, optimizer)
        if outer is not None and optimizer is not None and self.is_chief:  # one worker sets it, before its next push
            load_outer_state(optimizer, outer, self.unwrap(model))

    def at_preemption_boundary(self) -> bool:
        """True right after an outer step under DiLoCo (every worker holds the global model); always otherwise."""
        return self._diloco is None or self._diloco.window_empty()

    def checkpoint_io(self) -> CheckpointIO:
        """The chief writes every checkpoint tensor: the state lives on ps tasks, which do not run the script."""
        return self.__dict__.setdefault("_checkpoint_io", CheckpointIO(collective=False))

    def ps_stats(self) -> list[dict[str, Any]]:
        """Return each ps task's stats (``version``, ``worker_versions``, ``max_lead``, ``dead``); on a ps, its own.

        On a ps task that served until the workers saved on a preemption notice (``exit_on_ps=False``),
        ``preempted_at_step`` is the step they saved at: exit with ``PREEMPTED_EXIT_CODE`` for a restart.
        """
        if self.roles.is_ps:
            return [dict(self._stats or {})]
        return self._require_worker("ps_stats").stats()

    def wire_stats(self) -> dict[str, float]:
        """Return this worker's traffic with the ps tasks so far (``traffic.wire_stats``; zeros on a ps task)."""
        links = self._client.links if self._client is not None else []
        return wire_stats(links, self._sparse, self._bound, self._diloco)

    def shutdown(self) -> None:
        """Tell the ps tasks this worker is done (idempotent; also runs at exit)."""
        if self._client is not None and not self._client.closed:
            if self._diloco is not None:
                self._diloco.report(self.wire_stats())
            self._client.bye()

    def __repr__(self) -> str:
        role = f"ps task {self.roles.index}" if self.roles.is_ps else f"worker {self.roles.index}"
        return (f"ParameterServerStrategy({role}, {self.roles.num_workers} worker(s), {self.num_ps} ps, "
                f"mode={self.mode!r}, staleness={self.staleness})")
