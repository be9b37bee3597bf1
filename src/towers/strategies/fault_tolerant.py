"""FaultTolerantStrategy: replicated data parallelism over replica groups that survives a lost group (torchft).

Each process is one *replica group* (a group of one process). The groups agree on a quorum
before every step through torchft's lighthouse; a group that dies drops out of the next quorum
and the others go on without a restart; a restarted group joins a later quorum, fetches the
model and optimizer state from a live peer ("heals") and trains on. torchft does the quorum,
the reconfigurable Gloo process group, the per-step commit vote and the state transfer; this
module puts the towers API on top:

* ``prepare`` wraps the model in torchft's DDP (gradients SUMMED over the live groups: every
  group's loss is already divided by the global batch, ``compute_average_loss``) and the
  optimizer in a wrapper that steps only when torchft's ``should_commit`` says the step's
  all-reduce succeeded everywhere.
* ``distribute_dataset`` hands out global batch ``s`` of the data for committed step ``s``,
  split over the groups of *that step's* quorum: after a loss the survivors take the lost
  group's share. A step that was in flight when a group died does not commit; the next step
  retries the same global batch over the survivors (counted in ``steps_not_committed`` and
  logged), so no example is lost. A healed group continues at the live peers' step.
* ``reduce``/``gather``/``barrier``/object exchange run over the live groups (torchft's
  process group of the current quorum).

The knob is ``peer_timeout_s`` (default 3 s): how long a collective waits for a peer before the
step is given up, and (``start_lighthouse(peer_timeout_s=...)``) how long the lighthouse waits
for a silent group before forming a quorum without it. torchft is an optional extra:
``pip install 'towers[ft]'``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from towers._batch import BatchInfo, attach_batch_info, find_batch_info, shard_bounds, to_device
from towers._logging import get_logger
from towers.checkpoint.layout import CheckpointIO
from towers.cluster.info import ProcessInfo
from towers.errors import user_error
from towers.strategies._collectives import _local_reduce, as_tensor, check_op
from towers.strategies.base import ReplicaContext, Strategy
from towers.strategies.precision import Precision, resolve_precision

__all__ = ["FaultTolerantStrategy", "Lighthouse", "start_lighthouse", "DEFAULT_PEER_TIMEOUT_S"]

log = get_logger(__name__)

#: Default of ``peer_timeout_s``: the longest a live group waits for a lost one.
DEFAULT_PEER_TIMEOUT_S = 3.0

_INSTALL_FIX = ("Install the optional extra: pip install 'towers[ft]' (torchft>=0.2, which needs torch>=2.7), "
                "or pick another strategy (mirrored).")


def _torchft() -> Any:
    """Return the ``torchft`` module, or raise an ImportError that names the fix."""
    try:
        import torchft
        import torchft.checkpointing.pg_transport  # noqa: F401 (the transport healing uses)
        import torchft.coordination  # noqa: F401
        import torchft.ddp  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"FaultTolerantStrategy runs on torchft, which could not be imported. Received: "
                          f"{type(exc).__name__}: {exc}. {_INSTALL_FIX}") from exc
    return torchft


def _check_timeout(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise user_error(f"{name} must be a positive number of seconds", f"{name}={value!r}", f"Use e.g. {name}=5.")
    return float(value)


class Lighthouse:
    """A running torchft lighthouse: ``address`` (``"http://host:port"``, what the strategies take) and ``shutdown()``."""

    def __init__(self, server: Any, host: str) -> None:
        self._server = server
        port = int(str(server.address()).rsplit(":", 1)[1])
        self.address = f"http://{host}:{port}"

    def shutdown(self) -> None:
        """Stop the lighthouse (idempotent); groups still training then fail their next quorum."""
        with contextlib.suppress(Exception):
            self._server.shutdown()


def start_lighthouse(address: str = "127.0.0.1", port: int = 0, *, min_replicas: int = 1,
                     peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> Lighthouse:
    """Start torchft's lighthouse (the quorum server) in this process, bound to ``address:port``; return it.

    It runs on threads of this process until ``shutdown()`` (or the process ends). ``port=0``
    picks a free port. A group that sends no heartbeat for ``peer_timeout_s`` is left out of the
    next quorum, and a quorum waits at most as long for a live group that has not joined yet.
    ``min_replicas`` groups are needed for any quorum (keep 1 so that one survivor trains on).
    Give the strategies ``lighthouse=lighthouse.address``.
    """
    _torchft()
    from torchft.coordination import LighthouseServer

    timeout_ms = int(_check_timeout("peer_timeout_s", peer_timeout_s) * 1000)
    host = f"[{address}]" if ":" in address else address
    server = LighthouseServer(bind=f"{host}:{int(port)}", min_replicas=int(min_replicas), join_timeout_ms=timeout_ms,
                              quorum_tick_ms=20, heartbeat_timeout_ms=timeout_ms)
    lighthouse = Lighthouse(server, host)
    log.info("torchft lighthouse on %s (min_replicas=%d, peer_timeout_s=%s)", lighthouse.address, min_replicas,
             peer_timeout_s)
    return lighthouse


class _Steps:
    """Where the job is: the quorum of the step in progress (opened once, closed by the commit vote)."""

    def __init__(self) -> None:
        self.open = False
        self.not_committed = 0


class _FaultTolerantOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped only when every live group's all-reduce of this step succeeded."""

    def __init__(self, strategy: "FaultTolerantStrategy", optimizer: torch.optim.Optimizer) -> None:
        # No Optimizer.__init__: this object only forwards to the user's optimizer (torchft's OptimizerWrapper does the same).
        self.optimizer = optimizer
        self._strategy = strategy

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise user_error("FaultTolerantStrategy's optimizer takes no closure", "a closure",
                             "Compute the loss and call backward before optimizer.step().", cls=TypeError)
        if self._strategy._commit():
            return self.optimizer.step()
        return None


def _sum_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: SUM the bucket over the live groups through torchft (errors end the step, not the job).

    It waits for the all-reduce inside the hook, as torchft's own DDP does: returning torchft's
    error-handling future unwaited instead made each step ~25x slower here (its completion goes
    through torchft's timeout thread), so the all-reduce does not overlap the rest of backward.
    When a peer dies during the all-reduce, torchft 0.2.0 reports the error to the manager (the step
    will not commit) but leaves no future to return, and its own DDP hook then fails the backward
    pass (an AssertionError): here the bucket is returned as it is instead, and the step is dropped.
    """
    from torch.distributed import ReduceOp

    buffer = bucket.buffer()
    work = state.allreduce(buffer, reduce_op=ReduceOp.SUM)
    future = work.get_future() if work.wait() is not False else None
    inner = getattr(future, "_fut", future)
    if isinstance(inner, torch.futures.Future):
        return inner
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)  # garbage or partial sums: should_commit is False for this step on every group
    return done


# DDP checks the hook's annotations against the real classes (this module's are strings).
_sum_hook.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}


class FaultTolerantStrategy(Strategy):
    """Synchronous data parallelism over replica groups that survives a lost group, on torchft.

    Options: ``lighthouse`` (the lighthouse's address, ``"http://host:port"``; None: torchft's
    ``TORCHFT_LIGHTHOUSE``), ``replica_group_id`` (None: this process's rank), ``peer_timeout_s``
    (default 3: how long a collective waits for a peer before the step is given up),
    ``min_replicas`` (groups needed to commit a step, default 1), ``quorum_timeout_s`` (how long a
    step waits for a quorum, e.g. for the lighthouse) and ``address`` (where this group's store and
    servers are reached; None: ``info.master_addr``). One process per group; ``precision="32"``.
    """

    name = "fault_tolerant"

    def __init__(self, *, info: ProcessInfo | None = None, lighthouse: str | None = None,
                 replica_group_id: int | None = None, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 min_replicas: int = 1, quorum_timeout_s: float = 60.0, address: str | None = None,
                 precision: "str | int | Precision | None" = "32"):
        from towers import cluster

        peer_timeout_s = _check_timeout("peer_timeout_s", peer_timeout_s)
        quorum_timeout_s = _check_timeout("quorum_timeout_s", quorum_timeout_s)
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise user_error("min_replicas must be an integer >= 1", f"min_replicas={min_replicas!r}",
                             "Use 1 so that a single surviving group trains on.")
        info = info or cluster.from_env()
        self._info = info
        self._device = torch.device("cpu")
        self._precision = resolve_precision(precision, self._device)
        if self._precision.enabled:
            raise user_error("FaultTolerantStrategy computes in float32 only (for now)", f"precision={precision!r}",
                             "Use precision='32', or MirroredStrategy for mixed precision.")
        torchft = _torchft()
        from torch.distributed import TCPStore
        from torchft.checkpointing.pg_transport import PGTransport

        self.replica_group_id = int(info.rank if replica_group_id is None else replica_group_id)
        self.peer_timeout_s = peer_timeout_s
        host = address or info.master_addr
        timeout = timedelta(seconds=peer_timeout_s)
        # The group's own store (one process per group: this one is its master); torchft's managers and its
        # per-quorum process groups meet there.
        self._store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
        self._pg = torchft.ProcessGroupGloo(timeout=timeout)
        transport = PGTransport(self._pg, timeout=timeout, device=self._device)
        try:
            self._manager = torchft.Manager(
                pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
                use_async_quorum=False,  # heal before the forward pass, so a healed group computes on the live weights
                timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
                connect_timeout=timedelta(seconds=quorum_timeout_s), rank=0, world_size=1,
                store_addr=host, store_port=self._store.port, lighthouse_addr=lighthouse,
                replica_id=f"towers_ft_{self.replica_group_id}", hostname=host, checkpoint_transport=transport)
        except KeyError as exc:  # torchft reads TORCHFT_LIGHTHOUSE when no address is given
            raise user_error("FaultTolerantStrategy needs the address of a torchft lighthouse", f"lighthouse={lighthouse!r} "
                             "and no TORCHFT_LIGHTHOUSE", "Start one (towers.strategies.fault_tolerant.start_lighthouse, "
                             "or torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510) and pass "
                             "lighthouse='http://host:port' to the strategy.") from exc
        self._steps = _Steps()
        self._lighthouse = lighthouse or "(TORCHFT_LIGHTHOUSE)"
        self._quorum_timeout_s = quorum_timeout_s
        self._user_modules: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._closed = False
        log.info("FaultTolerantStrategy: replica group %d (lighthouse %s, peer_timeout_s=%s, min_replicas=%d)",
                 self.replica_group_id, lighthouse or "from TORCHFT_LIGHTHOUSE", peer_timeout_s, min_replicas)

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
        """The groups in the current step's quorum (1 before the first step)."""
        return max(1, self._manager.num_participants())

    @property
    def replica_id(self) -> int:
        """This group's rank in the current step's quorum (0 before the first step)."""
        rank = self._manager.participating_rank()
        return 0 if rank is None else int(rank)

    @property
    def current_step(self) -> int:
        """Steps committed by the job so far (the same on every live group; a healed group gets the peers' count)."""
        return int(self._manager.current_step())

    @property
    def steps_not_committed(self) -> int:
        """Steps this group computed that did not commit (a group was lost or healing failed mid-step)."""
        return self._steps.not_committed

    # --- steps ----------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """Join the quorum of the next step (once per step); a group that is behind heals here, from a live peer."""
        if self._steps.open:
            return
        if not self._user_modules:
            raise RuntimeError("FaultTolerantStrategy: a step began before any model was prepared. Expected "
                               "`model, optimizer = strategy.prepare(model, optimizer)` before iterating the dataset "
                               "or calling strategy.run (a healing group loads the live state into them).")
        try:
            self._manager.start_quorum()
        except Exception as exc:  # torchft raises the RPC's TimeoutError or a connection error
            raise RuntimeError(
                f"replica group {self.replica_group_id}: no quorum from the lighthouse {self._lighthouse} within "
                f"quorum_timeout_s={self._quorum_timeout_s} ({type(exc).__name__}: {exc}). The lighthouse is the job's "
                f"single point: without it every group stops at its last committed step ({self.current_step}). "
                "Restart the lighthouse, then the groups (from the last checkpoint).") from exc
        self._steps.open = True

    def _commit(self) -> bool:
        """The commit vote of the step in progress: True when every live group's all-reduce succeeded."""
        self._begin_step()
        committed = bool(self._manager.should_commit())
        self._steps.open = False
        if not committed:
            self._steps.not_committed += 1
            log.warning("replica group %d: step %d did not commit (%s); its update is dropped and the same global "
                        "batch is retried over the groups still alive", self.replica_group_id, self.current_step,
                        self._manager.errored() or "not enough replica groups")
        return committed

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this group's step, in the quorum of the step (joined here if not yet)."""
        kwargs = dict(kwargs or {})
        self._begin_step()
        with self._entered(self._replica_context(find_batch_info(args, kwargs))):
            return fn(*args, **kwargs)

    def _replica_context(self, batch: BatchInfo | None) -> ReplicaContext:
        if batch is None:
            return ReplicaContext(self)
        return ReplicaContext(self, global_batch_size=batch.examples_per_update,
                              num_padding_examples=batch.num_padding_examples)

    # --- preparation ----------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False) -> tuple[nn.Module, Any]:
        """Return ``(model, optimizer)``: the model in torchft's DDP (gradients summed over the live groups) and an
        optimizer that steps only on a committed step. The model and optimizer state is what a healing group fetches.

        Raises:
            TypeError: when ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
            ValueError: when the model was already prepared.
        """
        from torchft.ddp import DistributedDataParallel

        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare expects an nn.Module as model. Received: {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"prepare expects a torch.optim.Optimizer (or None) as optimizer. Received: {type(optimizer).__name__}.")
        if any(model is m for m in self._user_modules):
            raise ValueError(f"This {type(model).__name__} was already prepared by this strategy. Call prepare once per "
                             "model and keep using the model it returned.")
        model = model.to(self._device)
        manager = self._manager

        class _SummingDDP(DistributedDataParallel):  # torchft's DDP averages; towers' losses are already / global batch
            _comm_hook = staticmethod(_sum_hook)

        wrapped = _SummingDDP(manager, model)
        key = f"model_{len(self._user_modules)}"
        user_optimizer = optimizer

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(),
                    "optimizer": user_optimizer.state_dict() if user_optimizer is not None else None}

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            if user_optimizer is not None and state["optimizer"] is not None:
                user_optimizer.load_state_dict(state["optimizer"])
            log.info("replica group %d healed %s from a live peer (step %d)", self.replica_group_id, key,
                     self.current_step)

        manager.register_state_dict_fn(key, load_state_dict, state_dict)
        self._user_modules.append(model)
        compiled = self._compile(wrapped, compile)
        if optimizer is None:
            return compiled, None
        self._optimizers.append(optimizer)
        return compiled, _FaultTolerantOptimizer(self, optimizer)

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
                           collate_fn: Callable[[list[Any]], Any] | None = None) -> "FaultTolerantBatches":
        """Return this group's share of each global batch of a map-style ``dataset``, split over each step's quorum.

        Iterating yields, for committed step ``s``, global batch ``s mod len(self)`` of epoch
        ``s // len(self)``, split over the groups in the step's quorum; an iteration ends at the end
        of the epoch it began in, or when ``max_steps`` steps are committed. A step that did not
        commit is retried with the same global batch.

        Raises:
            ValueError: when ``global_batch_size`` is not a positive integer or the dataset is empty.
        """
        return FaultTolerantBatches(self, dataset, global_batch_size, shuffle=shuffle, seed=seed,
                                    drop_remainder=drop_remainder, max_steps=max_steps, collate_fn=collate_fn)

    # --- communication (over the live groups of the current quorum) -----------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> torch.Tensor:
        from torch.distributed import ReduceOp

        if self._manager._quorum_future is None:  # before the first step: this group alone
            return tensor
        work = self._manager.allreduce(tensor, reduce_op={"sum": ReduceOp.SUM, "max": ReduceOp.MAX,
                                                          "min": ReduceOp.MIN}[op])
        work.wait()
        if self._manager.errored():
            raise RuntimeError(f"replica group {self.replica_group_id}: {what} failed over the live replica groups: "
                               f"{self._manager.errored()}. A group was lost since this step's quorum; the next step's "
                               "quorum leaves it out. Call it again after the next step.")
        return tensor

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine ``value`` over the live groups with ``op`` (see ``Strategy.reduce``)."""
        op = check_op(op)
        tensor = as_tensor(value, self._device)
        if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
            tensor = tensor.double()
        if axis is None:
            out = self._all_reduce(tensor.clone(), "sum" if op == "mean" else op, f"strategy.reduce({op!r})")
            return out / self.num_replicas_in_sync if op == "mean" else out
        axis = axis + tensor.dim() if axis < 0 else axis
        local, count = _local_reduce(op, tensor, axis)
        if count is None:
            return self._all_reduce(local, op, f"strategy.reduce({op!r})")
        packed = self._all_reduce(torch.cat([local.reshape(-1), count.reshape(1).to(local.dtype)]), "sum",
                                  f"strategy.reduce({op!r})")
        return (packed[:-1] / packed[-1]).reshape(local.shape)

    def gather(self, value: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Concatenate every live group's ``value`` along ``axis`` (ragged sizes allowed), in quorum order."""
        tensor = as_tensor(value, self._device)
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        axis = axis + tensor.dim() if axis < 0 else axis
        n, me = self.num_replicas_in_sync, self.replica_id
        if n == 1:
            return tensor
        sizes = torch.zeros(n, dtype=torch.long)
        sizes[me] = tensor.shape[axis]
        lengths = [int(s) for s in self._all_reduce(sizes, "sum", "strategy.gather")]
        moved = tensor.movedim(axis, 0)
        dtype = torch.uint8 if moved.dtype == torch.bool else moved.dtype
        slab = torch.zeros((n, max(lengths), *moved.shape[1:]), dtype=dtype)
        slab[me, :moved.shape[0]] = moved.to(dtype)
        slab = self._all_reduce(slab, "sum", "strategy.gather")
        out = torch.cat([slab[r, :lengths[r]] for r in range(n)]).to(moved.dtype)
        return out.movedim(0, axis)

    def barrier(self) -> None:
        """Return when every live group reached this point (or raise when one was lost meanwhile)."""
        self._all_reduce(torch.zeros(1), "sum", "strategy.barrier")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return every live group's ``obj``, in quorum order (JSON values and tensors: never a pickle).

        Raises:
            TypeError: ``obj`` holds something other than JSON values, tuples and dense tensors.
        """
        from towers.strategies.parameter_server.wire import decode, encode

        n = self.num_replicas_in_sync
        if n == 1:
            return [obj]
        raw, tensors = encode(obj)
        blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
        data = torch.cat([torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8),
                          blob])
        gathered = self.gather(data)
        sizes = self.gather(torch.tensor([len(raw), data.numel()]).reshape(1, 2)).reshape(-1, 2).tolist()
        parts, start = [], 0
        for json_bytes, total in sizes:
            part = gathered[start:start + total]
            parts.append(decode(part[:json_bytes].numpy().tobytes(), part[json_bytes:]))
            start += total
        return parts

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return group ``src``'s ``obj`` (its rank in the current quorum) on every live group."""
        return self.all_gather_object(obj if self.replica_id == src else None)[src]

    def checkpoint_io(self) -> CheckpointIO:
        """Every group holds the whole state: the chief writes checkpoints alone (no collective over a changing quorum)."""
        return self.__dict__.setdefault("_checkpoint_io", CheckpointIO(collective=False))

    def shutdown(self) -> None:
        """Leave the quorum and stop this group's torchft servers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self._pg.shutdown()


class FaultTolerantBatches:
    """This group's share of each global batch, for the step the job is at (see ``FaultTolerantStrategy.distribute_dataset``)."""

    def __init__(self, strategy: FaultTolerantStrategy, dataset: Any, global_batch_size: int, *, shuffle: bool,
                 seed: int, drop_remainder: bool, max_steps: int | None,
                 collate_fn: Callable[[list[Any]], Any] | None) -> None:
        from torch.utils.data import default_collate

        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise user_error("global_batch_size must be a positive integer", repr(global_batch_size),
                             "It is the number of examples per step summed over all replica groups.")
        size = len(dataset)
        full, rest = divmod(size, global_batch_size)
        self.num_batches = full + (1 if rest and not drop_remainder else 0)
        if self.num_batches == 0:
            raise user_error("The dataset has no complete global batch", f"{size} example(s), global_batch_size="
                             f"{global_batch_size}, drop_remainder={drop_remainder}",
                             "Use a smaller global_batch_size or drop_remainder=False.")
        self._strategy, self._dataset, self.global_batch_size = strategy, dataset, global_batch_size
        self._size, self._shuffle, self._seed, self._max_steps = size, bool(shuffle), int(seed), max_steps
        self._collate = collate_fn or default_collate

    def __len__(self) -> int:
        return self.num_batches

    def _order(self, epoch: int) -> torch.Tensor:
        if not self._shuffle:
            return torch.arange(self._size)
        return torch.randperm(self._size, generator=torch.Generator().manual_seed(self._seed + epoch))

    def __iter__(self) -> Iterator[Any]:
        strategy, first_epoch = self._strategy, None
        while self._max_steps is None or strategy.current_step < self._max_steps:
            strategy._begin_step()  # the quorum (and healing) first: it decides the split and the step
            step = strategy.current_step
            epoch, index = divmod(step, self.num_batches)
            first_epoch = epoch if first_epoch is None else first_epoch
            if epoch != first_epoch:
                return  # the quorum stays open for the next iteration's first step
            indices = self._order(epoch)[index * self.global_batch_size:(index + 1) * self.global_batch_size]
            n, me = strategy.num_replicas_in_sync, strategy.replica_id
            lo, hi = shard_bounds(len(indices), n, me)
            if hi == lo:
                raise user_error(f"Global batch {index} has fewer examples than the {n} live replica groups",
                                 f"{len(indices)} example(s)", "Use a larger global_batch_size or drop_remainder=True.")
            batch = to_device(self._collate([self._dataset[int(i)] for i in indices[lo:hi]]), strategy.device)
            yield attach_batch_info(batch, BatchInfo(
                index=index, num_batches=self.num_batches, global_batch_size=len(indices), local_batch_size=hi - lo,
                num_padding_examples=0, examples_per_update=len(indices), batches_per_update=1, last_in_update=True))
