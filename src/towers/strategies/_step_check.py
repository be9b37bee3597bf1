"""Replicas stay in step or stop: each gradient all-reduce carries the identity of the step that made it.

Collectives pair by order, not by meaning. A replica that runs one batch more than the others (a
rank-dependent loop), one less, or another epoch's batch would have its gradient all-reduce summed
with the others' next step, and every later one too, with no sign until the job ends. So every
synchronising step carries what this replica ran: its batch's epoch and global batch index (the
``BatchInfo`` that ``distribute_dataset`` attached, read by ``strategy.run`` into the ``StepTracker``)
and the micro-batches it ran since its last update. The strategy's tracker is read when DDP calls the
hook, which may be on autograd's thread: context variables would not be visible there.

Under DDP (Mirrored) the identity rides in one bucket's all-reduce: ``num_replicas`` slots of
``SLOT`` extra elements, this replica's identity as bytes in its own slot and zeros in the others'.
The SUM gives every replica every replica's identity exactly, in float32, fp16 or bf16 alike (a
byte is exact in each), for a few elements on the wire and a copy of that bucket in and out. The
bucket is the smallest of the last backward's (bucket 0 in the first one, before DDP settles its
layout), so the copy is cheap: DDP's layout is the same on every replica, and so is the choice.
As that backward ends, each replica compares; all got the same sum, so on a mismatch all raise
``MismatchedStepsError`` in the same step, each naming what it ran and what the others ran, and
no other collective is started (they are already out of step).

Steps on batches without accounting (a user's own loader) carry "unknown" and compare equal:
``StepCounts`` (``_collectives.py``) counts those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from towers.strategies._collectives import MismatchedStepsError
from towers.strategies._steps import StepTracker

__all__ = ["SLOT", "StepIdentity", "StepCheck", "compare_before_step"]

#: Bytes per field of a replica's slot: known (0/1), epoch, global batch index, micro-batches since the last update.
_WIDTHS = (1, 2, 3, 1)
SLOT = sum(_WIDTHS)


@dataclass(frozen=True)
class StepIdentity:
    """What a replica ran in a synchronising step."""

    epoch: int
    index: int
    #: Runs (micro-batches) since this model's last synchronised step: 1 without accumulation.
    micro_batches: int

    def describe(self) -> str:
        """Return ``"epoch E, global batch I"`` (and the micro-batches, when not 1)."""
        more = "" if self.micro_batches == 1 else f" after {self.micro_batches} micro-batch(es) since its last update"
        return f"epoch {self.epoch}, global batch {self.index}{more}"


def _describe(identity: StepIdentity | None) -> str:
    return identity.describe() if identity is not None else "a batch without accounting (not from distribute_dataset)"


def encode(identity: StepIdentity | None) -> list[int]:
    """Return ``identity`` as ``SLOT`` bytes (all zero when unknown); larger values wrap."""
    if identity is None:
        return [0] * SLOT
    digits = [1]
    for value, width in zip((identity.epoch, identity.index, identity.micro_batches), _WIDTHS[1:]):
        value %= 256 ** width
        digits += [(value >> (8 * i)) & 255 for i in range(width)]
    return digits


def decode(digits: Sequence[int]) -> StepIdentity | None:
    """Return the identity ``encode`` wrote into ``digits`` (None: unknown)."""
    if not digits[0]:
        return None
    values, at = [], 1
    for width in _WIDTHS[1:]:
        values.append(sum(d << (8 * i) for i, d in enumerate(digits[at:at + width])))
        at += width
    return StepIdentity(*values)


class StepCheck:
    """The step identities of one prepared model's gradient all-reduces: what its first bucket carries, and the comparison."""

    def __init__(self, tracker: StepTracker, *, rank: int, num_replicas: int):
        self._tracker = tracker
        self.rank, self.num_replicas = rank, num_replicas
        self.numel = num_replicas * SLOT
        self._synced = tracker.started  # the tracker's runs at this model's last synchronised step
        self._fold = 0  # the bucket that carries the identity: the smallest of the last backward's
        self._sizes: list[int] = []  # this backward's bucket sizes so far (DDP reduces buckets in index order)

    def carries(self, index: int, numel: int, is_last: bool) -> bool:
        """Return whether bucket ``index`` (of ``numel`` elements) carries this step's identity; note its size."""
        if index == 0:
            self._sizes = []
        self._sizes.append(numel)
        carry = index == self._fold
        if is_last:  # the same layout on every replica: the same choice for the next step
            self._fold = min(range(len(self._sizes)), key=self._sizes.__getitem__)
        return carry

    def mark(self, dtype: torch.dtype, device: torch.device) -> tuple[StepIdentity | None, torch.Tensor]:
        """Start a synchronised step: return its identity and the ``numel`` elements that carry it (zeros but our slot)."""
        started, batch = self._tracker.started, self._tracker.batch
        micro, self._synced = started - self._synced, started
        identity = None if batch is None else StepIdentity(batch.epoch, batch.index, micro)
        values = [0] * self.numel
        values[self.rank * SLOT:(self.rank + 1) * SLOT] = encode(identity)
        return identity, torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    def compare_after_backward(self, identity: StepIdentity | None, summed: torch.futures.Future[Any],
                               start: int) -> None:
        """Compare the identities in ``summed`` (the all-reduce's future, from element ``start``) as this backward ends.

        DDP has waited for every bucket by then, so the check neither stalls the overlap of the
        backward with communication nor leaves an all-reduce behind; its error reaches the caller of
        ``backward()``. Outside a backward (not expected from DDP) it waits for the sum now.
        """
        def compare() -> None:
            self.compare(identity, summed.wait()[0][start:].tolist())

        engine: Any = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
        try:
            engine.queue_callback(compare)
        except RuntimeError:
            compare()

    def compare(self, identity: StepIdentity | None, values: Sequence[float]) -> None:
        """Return when every replica's slot in ``values`` (the summed elements) holds this replica's identity.

        Raises:
            MismatchedStepsError: naming this rank, what it ran and what each replica that differs ran.
        """
        slots = [[int(round(v)) for v in values[r * SLOT:(r + 1) * SLOT]] for r in range(self.num_replicas)]
        mine = slots[self.rank]
        others = [(rank, decode(slot)) for rank, slot in enumerate(slots) if slot != mine]
        if not others:
            return
        ran = "; ".join(f"rank {rank} ran {_describe(theirs)}" for rank, theirs in others)
        raise MismatchedStepsError(
            f"[rank {self.rank}/{self.num_replicas}] The replicas are out of step: this rank's gradient sync is "
            f"for {_describe(identity)}, but {ran}. Collectives pair by order, so a replica that runs a batch twice, "
            "skips one or takes another epoch's batch would have its gradients summed with other steps' for the rest "
            "of the job. Expected every replica to run the same batches of strategy.distribute_dataset in the same "
            "order: keep the training loop the same on every rank (no `if rank == ...` around strategy.run, a forward "
            "or a backward).")


def folded_sum(check: StepCheck, buffer: torch.Tensor, dtype: torch.dtype,
               all_reduce: Callable[[torch.Tensor], torch.futures.Future[Any]]) -> torch.futures.Future[torch.Tensor]:
    """All-reduce (SUM) ``buffer`` as ``dtype`` with the step's identity appended; return the summed ``buffer``'s future."""
    identity, mark = check.mark(dtype, buffer.device)
    n = buffer.numel()
    flat = torch.empty(n + mark.numel(), dtype=dtype, device=buffer.device)
    flat[:n].copy_(buffer)
    flat[n:].copy_(mark)
    fut = all_reduce(flat)
    check.compare_after_backward(identity, fut, n)

    def unpack(f: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(f.value()[0][:n])
        return buffer

    return fut.then(unpack)


def compare_before_step(check: StepCheck, device: torch.device, group: Any,
                        before: Callable[[], None] | None = None) -> Callable[[], None]:
    """A check the optimizer runs before each update where the gradient collective carries no identity (FSDP2's
    reduce-scatter): the replicas' step identities compared in one small all-reduce of their own (``before`` first)."""
    import torch.distributed as dist

    from towers.process_group import collective

    def compare_steps() -> None:
        if before is not None:
            before()
        identity, mark = check.mark(torch.float32, device)
        with collective("optimizer.step: the replicas' step identities"):
            dist.all_reduce(mark, group=group)
        check.compare(identity, mark.tolist())

    return compare_steps
