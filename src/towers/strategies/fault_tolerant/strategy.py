"""FaultTolerantStrategy: its options, ``prepare`` and its input, over two parts it holds.

The family's overview is the package's docstring (``towers.strategies.fault_tolerant``). The
strategy holds a ``QuorumSteps`` (``steps.py``: the group's torchft manager, the quorum of each
step and its commit vote) and a ``LiveGroupCollectives`` (``collectives.py``: the collectives over
the live groups); its methods of the same names call them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from towers._logging import configure_logging, configured_logging, get_logger, set_rank
from towers.checkpoint.layout import CheckpointIO
from towers.cluster.info import ProcessInfo
from towers.cluster.strategy_options import parse_flag
from towers.data import BatchInfo, find_batch_info
from towers.errors import FailedPreconditionError, InvalidArgumentError, InvalidTypeError, user_error
from towers.launch.lighthouse import DEFAULT_PEER_TIMEOUT_S, check_timeout
from towers.parallel.parallelize import ParallelOptions, parallelize
from towers.strategies.base import ReplicaContext, Strategy, note_built
from towers.strategies.fault_tolerant.batches import FaultTolerantBatches
from towers.strategies.fault_tolerant.bitwise import BitwiseGroups
from towers.strategies.fault_tolerant.collectives import LiveGroupCollectives
from towers.strategies.fault_tolerant.grads import GradientSync, sum_hook
from towers.strategies.fault_tolerant.groups import GroupLayout
from towers.strategies.fault_tolerant.optimizer import FaultTolerantOptimizer
from towers.strategies.fault_tolerant.shards import load_local_model, load_local_optimizer, local_state
from towers.strategies.fault_tolerant.steps import QuorumSteps
from towers.strategies.precision import Precision, resolve_precision

__all__ = ["FaultTolerantStrategy"]

log = get_logger(__name__)


class FaultTolerantStrategy(Strategy):
    """Synchronous data parallelism over replica groups that survives a lost group, on torchft.

    The group's store listens on ``address`` only (loopback on one host, where the group's Gloo
    sockets bind loopback too). torchft's manager server, in process 0 of each group, listens on
    every interface (torchft binds ``[::]``); ``manager_address`` (``"http://host:port"``, on every
    process of the group) says where.

    Args:
        info: this process's place in the job. Default: read from the environment.
        lighthouse: the lighthouse's address, ``"http://host:port"``. Default: torchft's
            ``TORCHFT_LIGHTHOUSE`` (as ``towers launch`` sets it).
        replica_group_id: the group this process belongs to. Default: from ``TOWERS_FT_GROUP*``
            (``towers launch``), else one process per group whose id is the rank.
        peer_timeout_s: how long a collective waits for a peer before the step is given up, in seconds.
        min_replicas: the groups needed to commit a step.
        quorum_timeout_s: how long a step waits for a quorum (e.g. for the lighthouse), in seconds.
        address: where this group's store and servers are reached. Default: ``info.master_addr`` on one
            host, the address of the interface that reaches the other hosts across hosts.
        group_size: the processes of each replica group (default as for ``replica_group_id``).
        group_rank: this process's rank within its group (default as for ``replica_group_id``).
        group_port: where process 0 of the group serves its store (default as for ``replica_group_id``).
        shard: FSDP2 inside groups of several processes; False: each group's processes replicate the model.
        shard_units: the FSDP units under ``shard=True``, as ``FullyShardedStrategy``'s.
        precision: ``"32"`` only (for now).
        bitwise: the same bits as one process through lost and healed groups (``micro_batch_size``: given, or a
            twelfth of the global batch; groups of one process).
        micro_batch_size: the examples of one micro-batch under ``bitwise=True``.

    Raises:
        ValueError: a timeout or ``min_replicas`` out of range, a precision other than ``"32"``, or
            ``shard=True`` on a group of one process.

    Example:
        <!-- not-run: needs a torchft lighthouse and replica groups: towers launch --strategy fault_tolerant -->
        ```python
        import towers

        strategy = towers.FaultTolerantStrategy(min_replicas=1, peer_timeout_s=3)
        model, optimizer = strategy.prepare(model, optimizer)  # a lost group drops out, a new one heals
        ```
    """

    name = "fault_tolerant"

    def __init__(self, *, info: ProcessInfo | None = None, lighthouse: str | None = None,
                 replica_group_id: int | None = None, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 min_replicas: int = 1, quorum_timeout_s: float = 60.0, address: str | None = None,
                 group_size: int | None = None, group_rank: int | None = None, group_port: int | None = None,
                 shard: bool = False, shard_units: Any = "auto", precision: "str | int | Precision | None" = "32",
                 bitwise: bool = False, micro_batch_size: int | None = None):
        from towers import cluster

        peer_timeout_s = check_timeout("peer_timeout_s", peer_timeout_s)
        quorum_timeout_s = check_timeout("quorum_timeout_s", quorum_timeout_s)
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise user_error("min_replicas must be an integer >= 1", f"min_replicas={min_replicas!r}",
                             "Use 1 so that a single surviving group trains on.")
        info = info or cluster.from_env()
        self._info = info
        lighthouse = lighthouse or info.lighthouse  # TORCHFT_LIGHTHOUSE, as towers launch sets it
        note_built(info, self.name)
        set_rank(info.rank, info.world_size)
        if info.log_level and not configured_logging():  # a worker of `towers launch`: its [rank r/w] output
            configure_logging(info.log_level)
        self._device = torch.device("cpu")
        self._precision = resolve_precision(precision, self._device)
        if self._precision.enabled:
            raise user_error("FaultTolerantStrategy computes in float32 only (for now)", f"precision={precision!r}",
                             "Use precision='32', or MirroredStrategy for mixed precision.")
        layout = GroupLayout.resolve(info, replica_group_id, group_size, group_rank, group_port)
        self.replica_group_id, self.group_size, self.group_rank = layout.group, layout.size, layout.rank
        self.peer_timeout_s = peer_timeout_s
        shard = parse_flag("shard", shard)  # True: FSDP2 inside each replica group; False: replicated
        if shard and layout.size == 1:
            raise user_error("shard=True shards the model over the processes of a replica group, and this group has "
                             "one", "group_size=1", "Run groups of several processes (towers launch --group-size N "
                             "--strategy fault_tolerant --strategy-option shard=true), or drop shard=True.")
        self.shard, self._shard_units = shard, shard_units
        build = BitwiseGroups.check(bitwise, micro_batch_size, shard=shard, group_size=layout.size)
        #: The gradient all-reduce ``prepare`` installs: ``"flat"`` (one flat buffer at the end of backward) or
        #: ``"ddp"`` (torchft's DDP wrapper, slower; kept to compare in benchmarks/ft_recovery.py).
        self.gradients = "flat"
        self._quorum = QuorumSteps(info, layout, lighthouse=lighthouse, address=address, peer_timeout_s=peer_timeout_s,
                                   quorum_timeout_s=quorum_timeout_s, min_replicas=min_replicas, shard=shard)
        self._collectives = LiveGroupCollectives(self._quorum, self._device)
        #: Where torchft's manager server (process 0 of the group, on every interface) is reached: ``"http://host:port"``.
        self.manager_address: str = self._quorum.manager_address
        self._optimizers: list[torch.optim.Optimizer] = []
        #: ``bitwise=True``: each step micro-batch by micro-batch, gradients summed over the fixed tree (``bitwise.py``)
        self._bitwise = None if build is None else BitwiseGroups(self, build)

    # --- who am I -------------------------------------------------------------------------------------
    @property
    def process_info(self) -> ProcessInfo:
        return self._info

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def precision(self) -> Precision:
        return self._precision

    @property
    def num_replicas_in_sync(self) -> int:
        """The replicas the job was launched with (the processes of every replica group), from construction on.

        What TensorFlow's ``GB = B * strategy.num_replicas_in_sync`` needs, the same before the first
        quorum as after a lost group: the global batch of a step stays whole (the live groups take the
        lost group's share). ``live_replicas`` is the count of the current step's quorum."""
        return self._quorum.launched_replicas

    # --- where the job is: the quorum of each step (QuorumSteps) ------------------------------------------
    @property
    def live_replicas(self) -> int:
        """The processes of the groups in the current step's quorum (``group_size`` before the first step): who
        splits the step's global batch and sums its gradients."""
        return self._quorum.live_replicas

    @property
    def replica_id(self) -> int:
        """This process's place among them: its group's rank in the quorum times ``group_size``, plus its rank in the
        group (``group_rank`` before the first step)."""
        return self._quorum.replica_id

    @property
    def current_step(self) -> int:
        """Steps committed by the job so far (the same on every live group; a healed group gets the peers' count)."""
        return self._quorum.current_step

    @property
    def steps_not_committed(self) -> int:
        """Steps this group computed that did not commit (a group was lost or healing failed mid-step)."""
        return self._quorum.not_committed

    def begin_step(self) -> None:
        """Join the quorum of the next step (once per step); a group that is behind heals here, from a live peer."""
        self._quorum.begin_step()

    def join_job(self) -> None:
        """Join the job if this group has taken part in no step yet: a group started again heals here (``begin_step``).

        Through this strategy's own ``begin_step``, as every step's quorum: what wraps it sees the first one too."""
        if not self._quorum.started:
            self.begin_step()

    def step_in_progress(self) -> bool:
        """True between a step's quorum and its commit vote."""
        return self._quorum.step_in_progress()

    def _commit(self) -> bool:
        """The commit vote of the step in progress (what the prepared optimizer's ``step()`` asks)."""
        return self._quorum.commit()

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this group's step, in the quorum of the step (joined here if not yet)."""
        kwargs = dict(kwargs or {})
        self._own_random_stream()
        self.begin_step()
        if self._bitwise is not None:
            return self._bitwise.run(fn, tuple(args), kwargs, self._replica_context)
        with self._entered(self._replica_context(find_batch_info(args, kwargs))):
            return fn(*args, **kwargs)

    def _replica_context(self, batch: BatchInfo | None, gradient_shares: int | None = None) -> ReplicaContext:
        context = (ReplicaContext(self) if batch is None else
                   ReplicaContext(self, global_batch_size=batch.examples_per_update,
                                  num_padding_examples=batch.num_padding_examples, gradient_shares=gradient_shares))
        context.num_replicas_in_sync = self.live_replicas  # who sums this step's gradients
        return context

    @property
    def _sums_replica_gradients(self) -> bool:
        return False  # its own optimizer steps on a committed step; losses are checked by its own rules

    # --- collectives over the live groups (LiveGroupCollectives) ---------------------------------------
    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` over the live groups with ``op`` (see ``Strategy.reduce``)."""
        tree = None if self._bitwise is None or axis is not None else self._bitwise.steps.reduce(op, value)
        return self._collectives.reduce(op, value, axis) if tree is None else tree

    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every live group's ``value`` along ``axis`` (ragged sizes allowed), in quorum order."""
        return self._collectives.gather(value, axis)

    def barrier(self) -> None:
        """Return when every live group reached this point (or raise when one was lost meanwhile)."""
        self._collectives.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every live group's ``obj``, in quorum order (JSON values and tensors: never a pickle).

        Raises:
            TypeError: ``obj`` holds something other than JSON values, tuples and dense tensors.
        """
        return self._collectives.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return group ``src``'s ``obj`` (its rank in the current quorum) on every live group."""
        return self._collectives.broadcast_object(obj, src)

    # --- preparation ----------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False, activation_checkpointing: str = "off") -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)``: the model in torchft's DDP (gradients summed over the live groups) and an
        optimizer that steps only on a committed step. The model and optimizer state is what a healing group fetches.

        Raises:
            TypeError: when ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
            ValueError: when the model was already prepared.
            RuntimeError: when another model was prepared and the job has committed steps since.
        """
        from torchft.ddp import DistributedDataParallel

        if not isinstance(model, nn.Module):
            raise InvalidTypeError(f"prepare expects an nn.Module as model. Received: {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidTypeError(
                f"prepare expects a torch.optim.Optimizer (or None) as optimizer. Received: {type(optimizer).__name__}.")
        if any(model is m for m in self._quorum.user_modules):
            raise InvalidArgumentError(f"This {type(model).__name__} was already prepared by this strategy. "
                                       "Call prepare once per model and keep using the model it returned.")
        if self._quorum.user_modules and self.current_step > 0:
            raise FailedPreconditionError(
                f"FaultTolerantStrategy trains the models prepared before its first step: this job committed "
                f"{self.current_step} step(s) with the {type(self._quorum.user_modules[0]).__name__} prepared first "
                f"before another model ({type(model).__name__}) was prepared. A replica group started again "
                "heals each model once, at its first step, so a model prepared later would keep its own values "
                "on that group (replicas that are no longer replicas), and its input would start at the job's "
                "step, not at its own first batch. Prepare every model before training, or train the second "
                "model in a job of its own (another towers launch).")
        model = parallelize(model.to(self._device), None, ParallelOptions(activation_checkpointing=activation_checkpointing))
        manager = self._quorum.manager

        class _SummingDDP(DistributedDataParallel):  # torchft's DDP averages; towers' losses are already / global batch
            _comm_hook = staticmethod(sum_hook)

        if self.shard:  # FSDP2 inside the group; each unit's reduce-scattered gradient shard summed across groups
            from towers.parallel.fsdp import build_mesh, fsdp_modules, shard_model

            if optimizer is not None and optimizer.state:
                raise user_error("FaultTolerantStrategy(shard=True).prepare needs an optimizer that has not stepped yet",
                                 "an optimizer with state", "Build the optimizer, call prepare, then train.")
            names = {id(p): n for n, p in model.named_parameters()}
            wrapped: nn.Module = shard_model(model, build_mesh(self.group_size, "cpu"), shard_units=self._shard_units)
            for unit in fsdp_modules(model):
                unit.set_all_reduce_hook(self._sum_over_groups)
            sharded = dict(model.named_parameters())  # fully_shard swapped them in: the optimizer must step those
            for group in optimizer.param_groups if optimizer is not None else ():
                group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
        elif self.gradients == "ddp":  # torchft's DDP, for the benchmark's comparison
            wrapped = _SummingDDP(manager, model)
        elif self._bitwise is not None:  # each micro-batch's gradient kept; the tree is summed after the last
            self._bitwise.watch(model)
            wrapped = model
        else:
            self._quorum.gradient_syncs.append(GradientSync(manager, model, group=self.replica_group_id,
                                                            intra=self._quorum.intra))
            wrapped = model
        key = f"model_{len(self._quorum.user_modules)}"
        user_optimizer = optimizer

        def state_dict() -> dict[str, Any]:  # a sharded model's DTensors travel as this process's local shards
            return local_state({"model": model.state_dict(),
                                "optimizer": user_optimizer.state_dict() if user_optimizer is not None else None})

        def load_state_dict(state: dict[str, Any]) -> None:
            if self.shard:
                load_local_model(model, state["model"])
            else:
                model.load_state_dict(state["model"])
            if user_optimizer is not None and state["optimizer"] is not None:
                if self.shard:
                    load_local_optimizer(user_optimizer, state["optimizer"])
                else:
                    user_optimizer.load_state_dict(state["optimizer"])
            log.info("replica group %d healed %s from a live peer (step %d)", self.replica_group_id, key,
                     self.current_step)

        manager.register_state_dict_fn(key, load_state_dict, state_dict)
        self._quorum.user_modules.append(model)
        compiled = self._compile(wrapped, compile)
        if optimizer is None:
            return compiled, None
        self._optimizers.append(optimizer)
        return compiled, FaultTolerantOptimizer(optimizer, commit=self._commit,
                                                updates_now=lambda: self._bitwise is None or self._bitwise.last)

    def _sum_over_groups(self, gradient: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: sum a unit's gradient shard with the same shard of the other live groups."""
        from torch.distributed import ReduceOp

        self._quorum.manager.allreduce(gradient, reduce_op=ReduceOp.SUM).wait()  # an error: this step does not commit

    def _prepared_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._optimizers)

    def _check_weighted_loss(self) -> None:
        raise user_error(
            "FaultTolerantStrategy does not normalise losses by weights yet (compute_average_loss(..., weights=...)): "
            "the division needs one more collective after the commit, over a quorum that may have changed",
            "compute_average_loss(..., weights=...)",
            "Use one loss per example (e.g. each sequence's mean over its tokens) with compute_average_loss(per_example), "
            "or MirroredStrategy for token-weighted losses.", cls=NotImplementedError)

    def distribute_dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0,
                           drop_remainder: bool = False, max_steps: int | None = None,
                           collate_fn: Callable[[list[Any]], Any] | None = None,
                           pad_empty_batches: bool = False, num_workers: int = 0, prefetch_factor: int | None = None,
                           persistent_workers: bool = False, pin_memory: bool | None = None,
                           **stream_options: Any) -> "FaultTolerantBatches":
        """Return this group's share of each global batch of a map-style ``dataset``, split over each step's quorum.

        The options are every strategy's (``towers.data.distribute_dataset``'s); loader workers
        (``num_workers > 0``) and stream options are refused with the reason: a step's share is
        known only once its quorum formed, so it is read in the training process.

        Iterating yields, for committed step ``s``, global batch ``s mod len(self)`` of epoch
        ``s // len(self)``, split over the groups in the step's quorum; an iteration ends at the end
        of the epoch it began in, or when ``max_steps`` steps are committed. A step that did not
        commit is retried with the same global batch.

        ``dataset`` is what ``towers.data.distribute_dataset`` takes for map-style data (a dataset, a
        tensor, a tuple or a dict of tensors). A replica whose share of a small last batch is empty
        gets 0 rows, or with ``pad_empty_batches`` one example of weight zero.

        Raises:
            ValueError: when ``global_batch_size`` is not a positive integer or the dataset is empty.
            TypeError: when ``dataset`` is a stream (not supported by this strategy yet) or not a dataset.
        """
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise user_error("num_workers must be an integer >= 0", f"num_workers={num_workers!r}",
                             "Use 0 (the batches are read in the training process).")
        if num_workers > 0:
            raise user_error(
                "FaultTolerantStrategy reads each step's share in the training process: which rows a replica "
                "trains is known only once the step's quorum formed (a lost group's share goes to the others)",
                f"num_workers={num_workers}", "Use num_workers=0 under FaultTolerantStrategy (the same script runs "
                "with loader workers under the other strategies).")
        if stream_options:
            raise user_error("FaultTolerantStrategy takes map-style data only (no stream options)",
                             sorted(stream_options), "Drop the stream options, or train a stream under another "
                             "strategy.", cls=TypeError)
        del prefetch_factor, persistent_workers, pin_memory  # they tune loader workers, which it does not run
        if self._bitwise is not None:  # shares of whole micro-batches
            self._bitwise.steps.check_batch_size(global_batch_size)
        return FaultTolerantBatches(self, dataset, global_batch_size, shuffle=shuffle, seed=seed,
                                    drop_remainder=drop_remainder, max_steps=max_steps, collate_fn=collate_fn,
                                    pad_empty_batches=pad_empty_batches,
                                    split_unit=1 if self._bitwise is None else self._bitwise.steps.micro_batch_size)

    # --- checkpoints and shutdown ---------------------------------------------------------------------
    def checkpoint_io(self) -> CheckpointIO:
        """Every group holds the whole state: the chief writes checkpoints alone (no collective over a changing quorum).

        Raises:
            NotImplementedError: with ``shard=True``, where no process holds the whole state.
        """
        if self.shard:
            raise user_error("Checkpoints of a FaultTolerantStrategy with shard=True are not supported yet: no single "
                             "process holds the whole state", "shard=True",
                             "Replicate inside the groups (shard=False) to write checkpoints, or use "
                             "FullyShardedStrategy for a sharded job that checkpoints.", cls=NotImplementedError)
        return self.__dict__.setdefault("_checkpoint_io", CheckpointIO(collective=False))

    def shutdown(self) -> None:
        """Leave the quorum and stop this group's torchft servers (idempotent)."""
        self._quorum.close()
