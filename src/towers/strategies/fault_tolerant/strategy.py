"""FaultTolerantStrategy: replicated data parallelism over replica groups that survives a lost group (torchft).

Processes form *replica groups* (by default one process each). The groups agree on a quorum
before every step through torchft's lighthouse; a group that dies drops out of the next quorum
and the others go on without a restart; a restarted group joins a later quorum, fetches the
model and optimizer state from a live peer ("heals") and trains on. torchft does the quorum,
the reconfigurable Gloo process group, the per-step commit vote and the state transfer; this
module puts the towers API on top:

* ``prepare`` sums the gradients over the live groups at the end of each backward pass, in one
  all-reduce (``_ft_grads``; SUMMED: every replica's loss is already divided by the global batch,
  ``compute_average_loss``), and wraps the
  optimizer in a wrapper that steps only when torchft's ``should_commit`` says the step's
  all-reduce succeeded everywhere.
* ``distribute_dataset`` hands out global batch ``s`` of the data for committed step ``s``,
  split over the groups of *that step's* quorum: after a loss the survivors take the lost
  group's share. A step that was in flight when a group died does not commit; the next step
  retries the same global batch over the survivors (counted in ``steps_not_committed`` and
  logged), so no example is lost. A healed group continues at the live peers' step.
* ``reduce``/``gather``/``barrier``/object exchange run over the live groups (torchft's
  process group of the current quorum).

A group is one process, or several on one node (``group_size``): replicating the model (gradients
summed inside the group, then across groups) or sharding it with FSDP2 (``shard=True``).

The knob is ``peer_timeout_s`` (default 3 s): how long a collective waits for a peer before the
step is given up, and (``start_lighthouse(peer_timeout_s=...)``) how long the lighthouse waits
for a silent group before forming a quorum without it. torchft is an optional extra:
``pip install 'towers[ft]'``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from towers._batch import BatchInfo, attach_batch_info, find_batch_info, map_tensors, shard_bounds, to_device
from towers._logging import configure_logging, configured_logging, get_logger, set_rank
from towers.checkpoint.layout import CheckpointIO
from towers.cluster.info import ProcessInfo
from towers.errors import user_error
from towers.launch.lighthouse import DEFAULT_PEER_TIMEOUT_S, Lighthouse, check_timeout, start_lighthouse
from towers.ledger.record import OrderSpec
from towers.strategies._collectives import _local_reduce, as_tensor, check_op
from towers.strategies._ft_grads import GradientSync
from towers.strategies._ft_shards import load_local_model, load_local_optimizer, local_state
from towers.strategies._ft_store import group_store
from towers.strategies.base import PeerLostError, ReplicaContext, Strategy, note_built
from towers.strategies.precision import Precision, resolve_precision
from towers.verify_capture import before_update

__all__ = ["FaultTolerantStrategy", "Lighthouse", "start_lighthouse", "DEFAULT_PEER_TIMEOUT_S"]

log = get_logger(__name__)

#: Seconds between quorum requests while the job's first step waits for a launched group.
_FIRST_QUORUM_POLL_S = 0.2

_INSTALL_FIX = ("Install the optional extra: pip install 'towers[ft]' (torchft>=0.2, which needs torch>=2.7), "
                "or pick another strategy (mirrored).")


def _torchft() -> Any:
    """Return the ``torchft`` module, or raise an ImportError that names the fix."""
    try:
        import torchft
        import torchft.checkpointing.transport  # noqa: F401 (the transport healing uses)
        import torchft.coordination  # noqa: F401
        import torchft.ddp  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"FaultTolerantStrategy runs on torchft, which could not be imported. Received: "
                          f"{type(exc).__name__}: {exc}. {_INSTALL_FIX}") from exc
    return torchft


def _own_address(info: ProcessInfo) -> str:
    """The address the other groups reach this one at: the rendezvous host on one host, else the address of the
    interface that reaches the other hosts (which torchft's Gloo groups then bind too)."""
    from towers.network import use_interface

    choice = use_interface(info)  # None on one host (or when no interface is named or needed)
    return (choice.interface.address if choice is not None else None) or info.master_addr




@dataclass(frozen=True)
class _GroupLayout:
    """Which replica group this process belongs to, its rank among the group's ``size`` processes, the store port."""

    group: int
    rank: int
    size: int
    port: int

    @staticmethod
    def resolve(info: ProcessInfo, group: int | None, size: int | None, rank: int | None,
                port: int | None) -> "_GroupLayout":
        """The arguments, else what ``towers launch`` set (``info.replica_group``), else one process per group."""
        slot = info.replica_group or (info.rank, 0, 1, 0)

        def pick(value: int | None, name: str, default: int) -> int:
            raw: Any = value if value is not None else default
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise user_error(f"{name} must be an integer", repr(raw), f"Pass e.g. {name}=0.")
            return raw

        layout = _GroupLayout(group=pick(group, "replica_group_id", slot[0]), rank=pick(rank, "group_rank", slot[1]),
                              size=pick(size, "group_size", slot[2]), port=pick(port, "group_port", slot[3]))
        if layout.size < 1 or not 0 <= layout.rank < layout.size or layout.group < 0:
            raise user_error("a replica group needs size >= 1, 0 <= rank < size and a group id >= 0",
                             f"group={layout.group}, group_rank={layout.rank}, group_size={layout.size}",
                             "Number the processes of a group 0..group_size-1 (towers launch --group-size does).")
        if layout.size > 1 and not 0 < layout.port < 65536:
            raise user_error("a replica group of several processes needs the port where its process 0 serves the "
                             "group's store", f"group_port={layout.port}",
                             "Run under towers launch --strategy fault_tolerant --group-size N, or pass the same free "
                             "group_port to every process of the group.")
        return layout


def _intra_group(store: Any, layout: _GroupLayout, timeout: timedelta) -> Any:
    """The process group of this replica group's own processes (None for a group of one)."""
    if layout.size == 1:
        return None
    import torch.distributed as dist

    if dist.is_initialized():
        raise user_error("FaultTolerantStrategy with groups of several processes makes the group's own process group "
                         "the default one, but a default process group exists already", "torch.distributed initialized",
                         "Build the strategy before any other strategy or init_process_group in this process.",
                         cls=RuntimeError)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"towers/ft/group{layout.group}", store), rank=layout.rank,
                            world_size=layout.size, timeout=timeout)
    return dist.group.WORLD


class _QuorumClient:
    """torchft's manager client, noting the replica group ids of each quorum it returns (for the logs)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.members: list[int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        with contextlib.suppress(Exception):  # the ids are "towers_ft_<group>[:...]"; anything else is not logged
            self.members = sorted(int(str(r).split(":")[0].rsplit("_", 1)[1]) for r in quorum.replica_ids)
        return quorum


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
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
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
    ``TORCHFT_LIGHTHOUSE``), ``peer_timeout_s`` (default 3: how long a collective waits for a peer
    before the step is given up), ``min_replicas`` (groups needed to commit a step, default 1),
    ``quorum_timeout_s`` (how long a step waits for a quorum, e.g. for the lighthouse), ``address``
    (where this group's store and servers are reached; None: ``info.master_addr`` on one host, the
    address of the interface that reaches the other hosts across hosts), ``shard``/``shard_units``
    (FSDP2 inside groups of several processes). Which group this process belongs to:
    ``replica_group_id``, ``group_size``, ``group_rank`` and ``group_port`` (where process 0 of
    the group serves its store), by default from ``TOWERS_FT_GROUP*`` (``towers launch``), else
    one process per group whose id is the rank. ``precision="32"``.

    The group's store listens on ``address`` only (loopback on one host, where the group's Gloo
    sockets bind loopback too). torchft's manager server, in process 0 of each group, listens on
    every interface (torchft binds ``[::]``); ``manager_address`` (``"http://host:port"``, on every
    process of the group) says where.
    """

    name = "fault_tolerant"

    def __init__(self, *, info: ProcessInfo | None = None, lighthouse: str | None = None,
                 replica_group_id: int | None = None, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 min_replicas: int = 1, quorum_timeout_s: float = 60.0, address: str | None = None,
                 group_size: int | None = None, group_rank: int | None = None, group_port: int | None = None,
                 shard: bool = False, shard_units: Any = "auto", precision: "str | int | Precision | None" = "32"):
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
        torchft = _torchft()
        from torchft.manager import MANAGER_ADDR_KEY

        from towers.strategies._ft_transport import WireTransport

        layout = _GroupLayout.resolve(info, replica_group_id, group_size, group_rank, group_port)
        self.replica_group_id, self.group_size, self.group_rank = layout.group, layout.size, layout.rank
        self.peer_timeout_s = peer_timeout_s
        if not isinstance(shard, bool):
            raise user_error("shard must be True or False", f"shard={shard!r}", "Use shard=True to shard the model "
                             "inside each replica group (FSDP2), False to replicate it.")
        if shard and layout.size == 1:
            raise user_error("shard=True shards the model over the processes of a replica group, and this group has "
                             "one", "group_size=1", "Run groups of several processes (towers launch --group-size N "
                             "--strategy fault_tolerant --strategy-option shard=true), or drop shard=True.")
        self.shard, self._shard_units = shard, shard_units
        host = address or _own_address(info)
        timeout = timedelta(seconds=peer_timeout_s)
        # The group's own store, served by member 0 on the group's address only: torchft's managers and per-quorum
        # process groups meet there, and so do the members' own process group (groups of several processes).
        self._store = group_store(host, layout.port, serves=layout.rank == 0, timeout_s=quorum_timeout_s)
        self._intra = _intra_group(self._store, layout, timeout)
        #: The gradient all-reduce ``prepare`` installs: ``"flat"`` (one flat buffer at the end of backward) or
        #: ``"ddp"`` (torchft's DDP wrapper, slower; kept to compare in benchmarks/ft_recovery.py).
        self.gradients = "flat"
        self._pg = torchft.ProcessGroupGloo(timeout=timeout)
        transport = WireTransport(self._pg, timeout)  # the live state as JSON and tensor bytes, never a pickle
        try:
            self._manager = torchft.Manager(
                pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
                use_async_quorum=False,  # heal before the forward pass, so a healed group computes on the live weights
                timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
                connect_timeout=timedelta(seconds=quorum_timeout_s), rank=layout.rank, world_size=layout.size,
                store_addr=host, store_port=self._store.port, lighthouse_addr=lighthouse,
                replica_id=f"towers_ft_{self.replica_group_id}", hostname=host, checkpoint_transport=transport)
        except KeyError as exc:  # torchft reads TORCHFT_LIGHTHOUSE when no address is given
            raise user_error("FaultTolerantStrategy needs the address of a torchft lighthouse", f"lighthouse={lighthouse!r} "
                             "and no TORCHFT_LIGHTHOUSE", "Start one (towers.strategies.fault_tolerant.start_lighthouse, "
                             "or torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510) and pass "
                             "lighthouse='http://host:port' to the strategy.") from exc
        # torchft's manager server (process 0 of the group) binds every interface itself: its address is said here.
        self.manager_address: str = self._store.get(MANAGER_ADDR_KEY).decode()
        self._quorum_client = _QuorumClient(self._manager._client)
        self._manager._client = self._quorum_client  # the same client, noting each quorum's members
        self._members: list[int] | None = None
        self._steps = _Steps()
        self._group_synced = False
        self._gradient_syncs: list[GradientSync] = []
        self._lighthouse = lighthouse or "(none given)"
        self._quorum_timeout_s = quorum_timeout_s
        self._user_modules: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._closed = False
        log.info("FaultTolerantStrategy: replica group %d, process %d of %d (lighthouse %s, peer_timeout_s=%s, "
                 "min_replicas=%d, store %s:%d, torchft manager %s on every interface)", self.replica_group_id,
                 layout.rank, layout.size, lighthouse or "from TORCHFT_LIGHTHOUSE", peer_timeout_s, min_replicas,
                 host, self._store.port, self.manager_address)

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
        return max(int(self._info.world_size), self.group_size)

    @property
    def live_replicas(self) -> int:
        """The processes of the groups in the current step's quorum (``group_size`` before the first step): who
        splits the step's global batch and sums its gradients."""
        return max(1, self._manager.num_participants()) * self.group_size

    @property
    def replica_id(self) -> int:
        """This process's place among them: its group's rank in the quorum times ``group_size``, plus its rank in the
        group (``group_rank`` before the first step)."""
        rank = self._manager.participating_rank()
        return (0 if rank is None else int(rank)) * self.group_size + self.group_rank

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
        self._start_quorum()
        if self.current_step == 0:
            self._await_launched_groups()
        self._steps.open = True
        self._note_members()
        if self._intra is not None and not self._group_synced and not self.shard:
            self._sync_group()

    def _start_quorum(self) -> None:
        try:
            self._manager.start_quorum()
        except Exception as exc:  # torchft raises the RPC's TimeoutError or a connection error
            raise RuntimeError(
                f"replica group {self.replica_group_id}: no quorum from the lighthouse {self._lighthouse} within "
                f"quorum_timeout_s={self._quorum_timeout_s} ({type(exc).__name__}: {exc}). The lighthouse is the job's "
                f"single point: without it every group stops at its last committed step ({self.current_step}). "
                "Restart the lighthouse, then the groups (from the last checkpoint).") from exc

    def _await_launched_groups(self) -> None:
        """Ask for quorums until one holds every launched group, while the job has committed no step.

        The lighthouse forms a quorum of whichever groups ask (``min_replicas``), so groups that start
        at different times could each commit the job's steps in quorums of their own: a group that
        starts late, or is started again after the others left, would train the whole job alone and
        end with other parameters. The first step therefore waits for every launched group (each in
        this quorum sees the same members and decides alike); from then on a group that comes back
        heals to the live step, as torchft does.

        Raises:
            RuntimeError: when the launched groups are not all there within ``quorum_timeout_s``.
        """
        launched = max(1, self.num_replicas_in_sync // self.group_size)
        deadline = time.monotonic() + self._quorum_timeout_s
        said = False
        while self.current_step == 0 and self._manager.num_participants() < launched:
            if not said:
                log.info("replica group %d: the job's first step waits for all %d launched replica groups (%d here)",
                         self.replica_group_id, launched, self._manager.num_participants())
                said = True
            if time.monotonic() > deadline:
                members = self._quorum_client.members
                raise user_error(
                    f"the job's first step needs all {launched} launched replica groups in one quorum",
                    f"replica group(s) {members if members is not None else '?'} within quorum_timeout_s="
                    f"{self._quorum_timeout_s} (this is replica group {self.replica_group_id})",
                    "Start every replica group (towers launch does); a group started again after the others ended "
                    "has no live group to heal from: the job is over. Groups started by hand: give each the job's "
                    "process count as ProcessInfo.world_size.", cls=RuntimeError)
            time.sleep(_FIRST_QUORUM_POLL_S)  # between quorum requests: the lighthouse answers at once
            self._start_quorum()

    def _sync_group(self) -> None:
        """Make the group's processes hold process 0's parameters and buffers, once, after their first quorum.

        torchft heals process r of a group from process r of a live group, and at the job's first step
        (every group at step 0, each with its own initial weights) process 0 and process 1 of a group
        may take them from different groups: without this, a group's processes would start apart.
        """
        import torch.distributed as dist

        for module in self._user_modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0, group=self._intra)
        self._group_synced = True

    def _note_members(self) -> None:
        """Log the groups that left or joined the quorum since the last step (named by their group ids)."""
        members = self._quorum_client.members
        before, self._members = self._members, members
        if before is None or members is None or members == before:
            return
        left, joined = sorted(set(before) - set(members)), sorted(set(members) - set(before))
        if left:
            log.warning("replica group %d: replica group(s) %s left the quorum at step %d (dead, stopped or unreachable "
                        "for peer_timeout_s=%s); training on with %d group(s)", self.replica_group_id,
                        ", ".join(map(str, left)), self.current_step, self.peer_timeout_s, len(members))
        if joined:
            log.info("replica group %d: replica group(s) %s joined the quorum at step %d (%d group(s))",
                     self.replica_group_id, ", ".join(map(str, joined)), self.current_step, len(members))

    def _join(self) -> None:
        """Join the job if this group has taken part in no step yet: a group started again heals here (``_begin_step``)."""
        if self._manager._quorum_future is None:
            self._begin_step()

    def _step_in_progress(self) -> bool:
        """True between a step's quorum and its commit vote."""
        return self._steps.open

    def _commit(self) -> bool:
        """The commit vote of the step in progress: True when every live group's all-reduce succeeded."""
        self._begin_step()
        committed = bool(self._manager.should_commit())
        self._steps.open = False
        for sync in self._gradient_syncs:
            sync.step_done()
        if not committed:
            self._steps.not_committed += 1
            log.warning("replica group %d: step %d did not commit (%s); its update is dropped and the same global "
                        "batch is retried over the groups still alive", self.replica_group_id, self.current_step,
                        self._manager.errored() or "not enough replica groups")
        return committed

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` as this group's step, in the quorum of the step (joined here if not yet)."""
        kwargs = dict(kwargs or {})
        self._own_random_stream()
        self._begin_step()
        with self._entered(self._replica_context(find_batch_info(args, kwargs))):
            return fn(*args, **kwargs)

    def _replica_context(self, batch: BatchInfo | None) -> ReplicaContext:
        context = (ReplicaContext(self) if batch is None else
                   ReplicaContext(self, global_batch_size=batch.examples_per_update,
                                  num_padding_examples=batch.num_padding_examples))
        context.num_replicas_in_sync = self.live_replicas  # who sums this step's gradients
        return context

    @property
    def _sums_replica_gradients(self) -> bool:
        return False  # its own optimizer steps on a committed step; losses are checked by its own rules

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

        if self.shard:  # FSDP2 inside the group; each unit's reduce-scattered gradient shard summed across groups
            from towers.strategies._fsdp import build_mesh, fsdp_modules, shard_model

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
        else:
            self._gradient_syncs.append(GradientSync(manager, model, group=self.replica_group_id, intra=self._intra))
            wrapped = model
        key = f"model_{len(self._user_modules)}"
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
        self._user_modules.append(model)
        compiled = self._compile(wrapped, compile)
        if optimizer is None:
            return compiled, None
        self._optimizers.append(optimizer)
        return compiled, _FaultTolerantOptimizer(self, optimizer)

    def _sum_over_groups(self, gradient: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: sum a unit's gradient shard with the same shard of the other live groups."""
        from torch.distributed import ReduceOp

        self._manager.allreduce(gradient, reduce_op=ReduceOp.SUM).wait()  # an error: this step does not commit

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
        return FaultTolerantBatches(self, dataset, global_batch_size, shuffle=shuffle, seed=seed,
                                    drop_remainder=drop_remainder, max_steps=max_steps, collate_fn=collate_fn,
                                    pad_empty_batches=pad_empty_batches)

    # --- communication (over the live groups of the current quorum) -----------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> torch.Tensor:
        from torch.distributed import ReduceOp

        reduce_op = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]
        if self._intra is not None:  # this group's processes first (a lost one fails this at once), then the groups
            import torch.distributed as dist

            dist.all_reduce(tensor, op=reduce_op, group=self._intra)
        if self._manager._quorum_future is None:  # before the first step: this group alone
            return tensor
        work = self._manager.allreduce(tensor, reduce_op=reduce_op)
        work.wait()
        if self._manager.errored():
            raise PeerLostError(f"replica group {self.replica_group_id}: {what} failed over the live replica groups: "
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
            return out / self.live_replicas if op == "mean" else out
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
        n, me = self.live_replicas, self.replica_id
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

        n = self.live_replicas
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
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            self._pg.shutdown()
        if self._intra is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class FaultTolerantBatches:
    """This group's share of each global batch, for the step the job is at (see ``FaultTolerantStrategy.distribute_dataset``).

    The Trainer's input (``DistributedBatches``) whose position is the job's (``FollowsJob``):
    committed step ``s`` is global batch ``s mod len(self)`` of epoch ``s // len(self)``, whichever
    group asks, so a group started again mid-job continues in the live groups' epoch at their step.
    """

    def __init__(self, strategy: FaultTolerantStrategy, dataset: Any, global_batch_size: int, *, shuffle: bool,
                 seed: int, drop_remainder: bool, max_steps: int | None,
                 collate_fn: Callable[[list[Any]], Any] | None, pad_empty_batches: bool = False) -> None:
        from towers.data import _source
        from towers.streams import is_stream

        if is_stream(dataset):
            raise user_error("FaultTolerantStrategy does not take streams yet", type(dataset).__name__,
                             "Give it a map-style dataset (a Dataset, a tensor, a tuple or a dict of tensors), or train "
                             "the stream under MirroredStrategy.", cls=NotImplementedError)
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise user_error("global_batch_size must be a positive integer", repr(global_batch_size),
                             "It is the number of examples per step summed over all replica groups.")
        self._source = _source(dataset, collate_fn)  # a dataset, a tensor, a tuple or a dict of tensors
        size = self._source.size
        full, rest = divmod(size, global_batch_size)
        self.num_batches = full + (1 if rest and not drop_remainder else 0)
        if self.num_batches == 0:
            raise user_error("The dataset has no complete global batch", f"{size} example(s), global_batch_size="
                             f"{global_batch_size}, drop_remainder={drop_remainder}",
                             "Use a smaller global_batch_size or drop_remainder=False.")
        self._strategy, self.global_batch_size = strategy, global_batch_size
        self._size, self._shuffle, self._seed, self._max_steps = size, bool(shuffle), int(seed), max_steps
        self._pad = bool(pad_empty_batches)
        #: Always None: every committed step trains its whole global batch (the Trainer counts committed steps).
        self.last_pass: dict[str, int] | None = None
        self._epoch = 0  # the epoch the next iter_from covers (set_epoch)

    def __len__(self) -> int:
        return self.num_batches

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (``len(self)``)."""
        return self.num_batches

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter_from`` covers (``set_epoch``; an iteration leaves it at the job's epoch)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter_from`` cover the job's steps of ``epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise user_error("epoch must be an integer >= 0", repr(epoch), "Pass the epoch to iterate, e.g. 0.")
        self._epoch = epoch

    def job_position(self) -> tuple[int, int]:
        """Return ``(epoch, batch)`` of the job's next step: ``divmod(strategy.current_step, len(self))``.

        A group that has taken part in no step yet joins the next quorum first: a group started again
        heals there to the live groups' step (and state), so every live group gets the same answer.
        Later calls only read the committed steps (no quorum is joined between steps).
        """
        self._strategy._join()
        epoch, batch = divmod(self._strategy.current_step, self.num_batches)
        return int(epoch), int(batch)

    def state_dict(self) -> dict[str, int]:
        """Return the job's position and the settings it depends on (for a checkpoint)."""
        epoch, batch = divmod(self._strategy.current_step, self.num_batches)
        return {"epoch": int(epoch), "batch": int(batch), "seed": self._seed, "global_batch_size": self.global_batch_size,
                "num_examples": self._size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check that ``state`` was saved for this input; the position stays the job's (its committed steps).

        Raises:
            ValueError: when the state belongs to a different dataset, batch size or seed.
        """
        for key, mine in (("seed", self._seed), ("global_batch_size", self.global_batch_size),
                          ("num_examples", self._size)):
            if key in state and int(state[key]) != mine:
                raise user_error(f"This data position was saved with another {key}", f"{key}={state[key]} (this "
                                 f"input: {mine})", "Resume with the same dataset, global_batch_size and seed.")

    def ledger_order(self) -> OrderSpec:
        """What fixes each epoch's example order, for the ledger."""
        return OrderSpec(self._size, self.global_batch_size, self._seed, self._shuffle)

    def _order(self, epoch: int) -> torch.Tensor:
        if not self._shuffle:
            return torch.arange(self._size)
        return torch.randperm(self._size, generator=torch.Generator().manual_seed(self._seed + epoch))

    def __iter__(self) -> Iterator[Any]:
        """Yield this group's share of the job's steps until the job leaves the epoch it is in now."""
        self._epoch = self.job_position()[0]
        return self.iter_from(0)

    def iter_from(self, batch: int) -> Iterator[Any]:
        """Yield this group's share of the job's steps while the job is in epoch ``self.epoch``.

        The job's committed steps decide which global batch comes next (a step that did not commit
        is retried with its batch; a group that healed continues at the live step), not ``batch``,
        which is only where the caller expects to start. Each batch must end with the prepared
        optimizer's ``step()`` (the commit vote) before the next one is taken.

        Raises:
            RuntimeError: when a batch is taken while the previous one's step has not voted.
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch <= self.num_batches:
            raise user_error(f"batch must be an integer in [0, {self.num_batches}]", repr(batch),
                             "Pass the index of a global batch of the epoch.")
        return self._steps(self._epoch)

    def _steps(self, epoch: int) -> Iterator[Any]:
        strategy, yielded = self._strategy, None
        while self._max_steps is None or strategy.current_step < self._max_steps:
            # The epoch's end is seen before joining the next quorum: the collectives the caller runs between
            # epochs (metrics, stop decision) stay in the last step's quorum, with the groups that took it.
            if strategy.current_step // self.num_batches != epoch:
                break
            if yielded is not None and strategy._step_in_progress():
                raise user_error(
                    "FaultTolerantStrategy's batches are the job's steps: each one must end with the prepared "
                    "optimizer's step() (the commit vote) before the next one is taken",
                    f"a batch after the one of step {yielded}, whose step has not voted yet",
                    "Call optimizer.step() once per batch. An evaluation pass (Trainer.evaluate, fit(validation_data="
                    "...)) is not supported under FaultTolerantStrategy yet: evaluate under another strategy.",
                    cls=RuntimeError)
            strategy._begin_step()  # the quorum (and healing) first: it decides the split and the step
            step = strategy.current_step
            step_epoch, index = divmod(step, self.num_batches)
            if step_epoch != epoch:
                break  # healed past the epoch: the quorum stays open for the next iteration's first step
            indices = self._order(epoch)[index * self.global_batch_size:(index + 1) * self.global_batch_size]
            n, me = strategy.live_replicas, strategy.replica_id
            lo, hi = shard_bounds(len(indices), n, me)
            padding = 1 if hi == lo and self._pad else 0
            # An empty share (fewer examples than replicas): the batch's first example, either as a zero-weight
            # padding example (pad_empty_batches) or for the batch's structure only (0 rows), as distribute_dataset does.
            rows = indices[:1] if hi == lo else indices[lo:hi]
            batch = self._source.fetch(rows)
            if hi == lo and not padding:
                batch = map_tensors(batch, lambda t: t[:0])
            yielded = step
            yield attach_batch_info(to_device(batch, strategy.device), BatchInfo(
                index=index, num_batches=self.num_batches, global_batch_size=len(indices), local_batch_size=hi - lo,
                num_padding_examples=padding, examples_per_update=len(indices), batches_per_update=1,
                last_in_update=True, epoch=epoch,
                rows=(index * self.global_batch_size + lo, index * self.global_batch_size + (hi if hi > lo else lo))))
        self._epoch = max(epoch, strategy.current_step // self.num_batches)
