"""How replicas talk outside DDP: ``reduce``, ``gather``, ``barrier`` and object exchange.

``LocalComm`` is the one-replica version (no process group); ``ProcessGroupComm`` uses the
default process group. Every method is a collective under ``ProcessGroupComm``: all replicas
call it in the same order.
"""

from __future__ import annotations

import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from towers.diagnostics import track
from towers.errors import InvalidArgumentError, InvalidTypeError, TowersError
from towers.process_group import collective, first_line
from towers.strategies._named import NamedAgreement, PartialCollectiveError, current_named_collective, named_collective
from towers.strategies.base import REDUCE_OPS

__all__ = ["LocalComm", "ProcessGroupComm", "StepCounts", "MismatchedStepsError", "PartialCollectiveError",
           "named_collective", "check_op", "as_tensor", "local_reduce", "float_for_mean", "replica_comm"]

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def check_op(op: str) -> str:
    """Return ``op`` lower-cased when it is one of ``REDUCE_OPS``.

    Raises:
        ValueError: naming the accepted reductions.
    """
    key = str(op).lower()
    if key not in REDUCE_OPS:
        raise InvalidArgumentError(f"reduce op must be one of {REDUCE_OPS}. Received: {op!r}. Use 'sum' or 'mean' for losses.")
    return key


def as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """Return ``value`` as a detached tensor on ``device`` (numbers become 0-d tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, (int, float, bool)):
        return torch.tensor(value, device=device)
    raise InvalidTypeError(
        f"strategy.reduce expects a tensor or a number (what strategy.run returned). Received: {type(value).__name__}. "
        "Return a tensor from the step function, or reduce each tensor of a structure separately.")


def local_reduce(op: str, value: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reduce over ``axis`` of this replica's value; for "mean" also return the count (ragged batches)."""
    if op in ("sum", "mean"):
        total = value.sum(dim=axis)
        return total, (torch.tensor(value.shape[axis], dtype=total.dtype, device=value.device) if op == "mean" else None)
    if value.shape[axis] == 0:  # an empty share: the identity of max/min
        shape = value.shape[:axis] + value.shape[axis + 1:]
        if value.is_floating_point():
            fill = float("-inf") if op == "max" else float("inf")
        else:
            info = torch.iinfo(value.dtype)
            fill = info.min if op == "max" else info.max
        return torch.full(shape, fill, dtype=value.dtype, device=value.device), None
    return (value.amax(dim=axis) if op == "max" else value.amin(dim=axis)), None


def float_for_mean(value: torch.Tensor) -> torch.Tensor:
    """Return ``value``, as float64 when it is neither floating nor complex (a mean of integers is not one)."""
    return value if value.is_floating_point() or value.is_complex() else value.double()


class MismatchedStepsError(TowersError, RuntimeError):
    """Replicas ran different numbers of steps before a collective; the message names the ranks and their counts."""


_RUN, _COLLECTIVE, _NAMED = 0, 1, 2
_IN_FLIGHT = 64


class StepCounts:
    """Catch replicas whose loaders yield different numbers of batches, at the first collective after the split.

    A step of a user's own loader (batches without ``BatchInfo``) is counted, and each count is
    sent, without waiting, on a small Gloo group of its own (``all_gather`` of ``[kind, count]``),
    so the hot path gains no blocking collective. Before ``reduce``/``gather``/``barrier``, each
    replica sends a marker on the same group and waits for it: the group pairs its collectives by
    sequence, so when one replica ran out of batches its marker pairs with another replica's next
    *step*, and the marker says so, with both counts, instead of the ``reduce`` pairing with that
    step's DDP all-reduce (a silent wrong result, or a "Connection closed by peer" blamed on the peer).
    Batches from ``distribute_dataset`` are aligned by construction and are not counted.

    Where no store agreement is possible (no watchdog runs), a named collective (``named_collective``)
    sends ``[_NAMED, tag]`` on the same group (``agree``), so it also pairs with another replica's step
    or collective marker, and is named.
    """

    def __init__(self, *, rank: int, num_replicas: int, timeout_s: float | None = None,
                 groups: list[list[int]] | None = None):
        self.rank, self.num_replicas = rank, num_replicas
        self.timeout_s = timeout_s
        #: The replica groups of a job whose replicas are not its processes (a model-parallel mesh): every
        #: process creates each group's side group, in order, and keeps its own.
        self._groups = groups
        self.steps = 0
        self._counting = False  # a counted step ran: collectives check the counts from then on
        self._group: Any = None
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []

    def _send(self, kind: int, value: int | None = None,
              timeout: timedelta | None = None) -> tuple[Any, list[torch.Tensor]]:
        """Send ``[kind, value or the step count]`` (``timeout``: the bound of the group's creation)."""
        if self._group is None:  # every replica's first counted step: they all create it in the same order
            if self._groups is None:
                self._group = dist.new_group(backend="gloo", timeout=timeout)
            else:
                me = dist.get_rank()
                for ranks in self._groups:
                    group = dist.new_group(ranks, backend="gloo", timeout=timeout)
                    if me in ranks:
                        self._group = group
        mine = torch.tensor([kind, self.steps if value is None else value], dtype=torch.long)
        parts = [torch.zeros_like(mine) for _ in range(self.num_replicas)]
        return dist.all_gather(parts, mine, group=self._group, async_op=True), parts

    def run(self) -> None:
        """Count one step and send the count (not waited for; a loop without collectives keeps 64 in flight)."""
        self.steps += 1
        self._counting = True
        self._pending.append(self._send(_RUN))
        if len(self._pending) > _IN_FLIGHT:  # long done by now: DDP's all-reduces keep the replicas in step
            work, _ = self._pending.pop(0)
            with collective("strategy.run: the replicas' step counts"):
                work.wait()

    def check(self, operation: str) -> None:
        """Return when every replica reached ``operation`` after as many steps as this one.

        Raises:
            MismatchedStepsError: naming this rank, its step count, and the ranks that were still
                running steps (or already waiting in a collective) with theirs.
        """
        if not self._counting:
            return
        work, parts = self._send(_COLLECTIVE)
        pending, self._pending = self._pending, []
        with collective(f"{operation}: the replicas' step counts"):
            for earlier, _ in pending:
                earlier.wait()
            work.wait()
        running = [(rank, int(p[1])) for rank, p in enumerate(parts) if int(p[0]) == _RUN]
        named = [rank for rank, p in enumerate(parts) if int(p[0]) == _NAMED]
        if named and not running:
            raise PartialCollectiveError(
                f"[rank {self.rank}/{self.num_replicas}] {operation} paired with a collective that every replica "
                f"must call (such as Metric.result()), which rank(s) {named} called and this rank did not. Call it "
                "on every replica at the same point of the loop (not inside `if strategy.is_chief:`).")
        if not running:
            return
        others = ", ".join(f"rank {rank} was starting step {count}" for rank, count in running)
        raise MismatchedStepsError(
            f"[rank {self.rank}/{self.num_replicas}] {operation} came after {self.steps} step(s) (strategy.run calls) "
            f"on rank {self.rank}, while {others}: the replicas' loaders yield different numbers of batches, so this "
            f"collective would pair with another replica's gradient all-reduce. Every replica must run the same number "
            "of steps. Use strategy.distribute_dataset(dataset, global_batch_size=...), which gives every replica "
            "the same number of batches (a short last batch is split, or padded), or make your loader's length the "
            "same on every replica (e.g. drop the remainder).")

    def agree(self, operation: str, fix: str) -> None:
        """Return when every replica is in the named collective ``operation`` (within half of ``timeout_s``).

        Half: a replica that went on to its next step waits there up to ``timeout_s`` for this one, so
        this error, which names the cause, comes first.

        Raises:
            PartialCollectiveError: a replica is elsewhere (a step, another collective, another named
                one), or not every replica arrived in time; the message names ``operation`` and ``fix``.
        """
        where = f"[rank {self.rank}/{self.num_replicas}] {operation}"
        tag = zlib.crc32(operation.encode("utf-8"))
        bound_s = None if self.timeout_s is None else self.timeout_s / 2
        timeout = None if bound_s is None else timedelta(seconds=bound_s)
        try:
            work, parts = self._send(_NAMED, tag, timeout)
            pending, self._pending = self._pending, []
            for earlier, _ in pending:
                earlier.wait()
            work.wait(timeout) if timeout is not None else work.wait()
        except RuntimeError as exc:
            raise PartialCollectiveError(
                f"{where} waited{'' if bound_s is None else f' {bound_s:g} s'} for the other replicas and not all of "
                f"them called it "
                f"({first_line(exc)}). It is a collective: every replica must call it. {fix}") from exc
        elsewhere = []
        for rank, (kind, value) in enumerate(p.tolist() for p in parts):
            if kind == _RUN:
                elsewhere.append(f"rank {rank} was starting step {value} (strategy.run)")
            elif kind == _COLLECTIVE:
                elsewhere.append(f"rank {rank} was in another collective (strategy.reduce, gather or barrier)")
            elif value != tag:
                elsewhere.append(f"rank {rank} was in another named collective")
        if elsewhere:
            raise PartialCollectiveError(
                f"{where} was called on rank {self.rank} while {', '.join(elsewhere)}: not every replica called it. "
                f"It is a collective: every replica must call it, at the same point of the loop. {fix}")


class LocalComm:
    """Collectives for a single replica: every value is already the result."""

    num_replicas = 1
    rank = 0

    def reduce(self, op: str, value: torch.Tensor, axis: int | None) -> torch.Tensor:
        if axis is None:
            return value.clone() if op != "mean" else float_for_mean(value).clone()
        if op == "mean":
            return float_for_mean(value).mean(dim=axis)
        return local_reduce(op, value, axis)[0]

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        return None

    def note_run(self, batch: Any) -> None:
        return None

    def gather(self, value: torch.Tensor, axis: int) -> torch.Tensor:
        return value

    def barrier(self) -> None:
        return None

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class ProcessGroupComm:
    """Collectives over the replicas: the default process group (gloo or nccl), or ``group``.

    ``group``: the replicas' group when they are not all the job's processes (a model-parallel mesh,
    whose processes of one model replica hold the same batch); ``groups``: every such group's ranks.
    """

    def __init__(self, *, rank: int, num_replicas: int, backend: str, timeout_s: float, group: Any = None,
                 groups: list[list[int]] | None = None):
        self.rank, self.num_replicas, self.backend, self.timeout_s = rank, num_replicas, backend, timeout_s
        self.group = group
        self._steps = StepCounts(rank=rank, num_replicas=num_replicas, timeout_s=timeout_s, groups=groups)
        self._named = NamedAgreement(rank=rank, num_replicas=num_replicas, timeout_s=timeout_s, group=group)

    def note_run(self, batch: Any) -> None:
        """Count a ``strategy.run`` (only for batches without ``BatchInfo``: ``distribute_dataset``'s are aligned)."""
        if batch is None:
            self._steps.run()

    def reduce(self, op: str, value: torch.Tensor, axis: int | None) -> torch.Tensor:
        named = current_named_collective()
        if named is not None:  # every replica must be in it: checked in the store (else on the side group)
            with track(named[0]):
                if self._named.agree(*named):
                    self._steps.check(named[0])  # a user's own loader's steps, counted as before any reduce
                else:
                    self._steps.agree(*named)
        else:
            self._steps.check(f"strategy.reduce({op!r})")
        with collective(f"strategy.reduce({op!r})"), track(f"strategy.reduce({op!r})"):
            if axis is None:
                out = (float_for_mean(value) if op == "mean" else value).clone()
                dist.all_reduce(out, op=_DIST_OPS[op], group=self.group)
                return out / self.num_replicas if op == "mean" else out
            local, count = local_reduce(op, float_for_mean(value) if op == "mean" else value, axis)
            if count is None:
                dist.all_reduce(local, op=_DIST_OPS[op], group=self.group)
                return local
            # One all-reduce for the sums and the example count: a true mean over ragged batches.
            packed = torch.cat([local.reshape(-1), count.reshape(1).to(local.dtype)])
            dist.all_reduce(packed, group=self.group)
            return (packed[:-1] / packed[-1]).reshape(local.shape)

    def all_reduce_max_(self, tensor: torch.Tensor) -> None:
        with collective("fp16 inf/NaN check"), track("fp16 inf/NaN check"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def gather(self, value: torch.Tensor, axis: int) -> torch.Tensor:
        self._steps.check("strategy.gather")
        with collective("strategy.gather"), track("strategy.gather"):
            value = value.detach().contiguous()
            size = torch.tensor([value.shape[axis]], dtype=torch.long, device=value.device)
            sizes = [torch.zeros_like(size) for _ in range(self.num_replicas)]
            dist.all_gather(sizes, size, group=self.group)
            lengths = [int(s.item()) for s in sizes]
            longest = max(lengths)
            if value.shape[axis] < longest:  # pad ragged shares to one shape for all_gather, cut after
                pad_shape = list(value.shape)
                pad_shape[axis] = longest - value.shape[axis]
                value = torch.cat([value, value.new_zeros(pad_shape)], dim=axis)
            parts = [torch.empty_like(value) for _ in range(self.num_replicas)]
            dist.all_gather(parts, value, group=self.group)
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(parts, lengths)], dim=axis)

    def barrier(self) -> None:
        self._steps.check("strategy.barrier")
        with collective("strategy.barrier"), track("strategy.barrier"):
            if self.backend == "gloo":
                # Names the rank(s) that did not arrive when the timeout expires.
                dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
            else:
                dist.barrier(group=self.group)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        with collective("strategy.broadcast_object"), track("strategy.broadcast_object"):
            box = [obj if self.rank == src else None]
            dist.broadcast_object_list(box, src=src if self.group is None else dist.get_global_rank(self.group, src),
                                    group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        with collective("strategy.all_gather_object"), track("strategy.all_gather_object"):
            out: list[Any] = [None] * self.num_replicas
            dist.all_gather_object(out, obj, group=self.group)
        return out


def replica_comm(mesh: Any, rank: int, world_size: int, *, backend: str, timeout_s: float) -> ProcessGroupComm:
    """The collectives over this process's data-parallel group on a ``LayoutMesh`` (``towers.parallel.layout``): the
    job's own group when every process is a replica, else the ``dp`` sub-mesh's (one replica spans tp or pp)."""
    layout = mesh.layout
    if not layout.model_parallel:
        return ProcessGroupComm(rank=rank, num_replicas=world_size, backend=backend, timeout_s=timeout_s)
    return ProcessGroupComm(rank=mesh.replica_id, num_replicas=layout.dp, backend=backend, timeout_s=timeout_s,
                            group=mesh.dp.get_group(), groups=layout.dp_groups())
