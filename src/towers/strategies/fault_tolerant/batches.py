"""The input of a FaultTolerantStrategy: this group's share of each global batch, for the step the job is at."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from towers.data._batch import BatchInfo, JobPosition, attach_batch_info, map_tensors, shard_bounds, to_device
from towers.errors import user_error
from towers.ledger.record import OrderSpec

if TYPE_CHECKING:
    from towers.strategies.fault_tolerant.strategy import FaultTolerantStrategy

__all__ = ["FaultTolerantBatches"]


def _committed(strategy: FaultTolerantStrategy, step: int) -> bool:
    """Whether the job's step ``step`` committed (the job's committed steps went past it)."""
    return strategy.current_step > step


class FaultTolerantBatches:
    """This group's share of each global batch, for the step the job is at (see ``FaultTolerantStrategy.distribute_dataset``).

    The Trainer's input (``DistributedBatches``) whose position is the job's: committed step ``s`` is
    global batch ``s mod len(self)`` of epoch ``s // len(self)``, whichever group asks, so a group
    started again mid-job continues in the live groups' epoch at their step. Each batch's
    ``JobPosition`` is its step's, and says after the step whether it committed.
    """

    def __init__(self, strategy: FaultTolerantStrategy, dataset: Any, global_batch_size: int, *, shuffle: bool,
                 seed: int, drop_remainder: bool, max_steps: int | None,
                 collate_fn: Callable[[list[Any]], Any] | None, pad_empty_batches: bool = False,
                 split_unit: int = 1) -> None:
        from towers.data._map_sources import map_source
        from towers.data.streams import is_stream

        if is_stream(dataset):
            raise user_error("FaultTolerantStrategy does not take streams yet", type(dataset).__name__,
                             "Give it a map-style dataset (a Dataset, a tensor, a tuple or a dict of tensors), or train "
                             "the stream under MirroredStrategy.", cls=NotImplementedError)
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise user_error("global_batch_size must be a positive integer", repr(global_batch_size),
                             "It is the number of examples per step summed over all replica groups.")
        self._source = map_source(dataset, collate_fn)  # a dataset, a tensor, a tuple or a dict of tensors
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
        self._unit = max(1, int(split_unit))  # shares of whole runs of this many examples (bitwise=True)
        #: Not recorded by the input: the Trainer records the batches it trained (``ExampleLedger``).
        self.in_ledger = False
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

    @property
    def examples_trained(self) -> None:
        """None: every committed step trains its whole global batch, which the Trainer counts."""
        return None

    def position_from(self, epoch: int, step: int, *, steps_per_epoch: int | None = None) -> tuple[int, int]:
        """Return ``(epoch, batch)`` of the job's next step, ``divmod(strategy.current_step, len(self))``, whatever
        the caller's ``(epoch, step)``.

        A group that has taken part in no step yet joins the next quorum first: a group started again
        heals there to the live groups' step (and state), so every live group gets the same answer.
        Later calls only read the committed steps (no quorum is joined between steps).

        Raises:
            ValueError: ``steps_per_epoch`` shorter than an epoch (the job's epochs are whole passes).
        """
        if steps_per_epoch is not None and steps_per_epoch < self.num_batches:
            raise user_error("steps_per_epoch must cover the whole dataset under FaultTolerantStrategy, whose epochs "
                             f"are the job's passes over it ({self.num_batches} steps)",
                             f"steps_per_epoch={steps_per_epoch}",
                             "Leave steps_per_epoch=None, or pass a smaller dataset (e.g. a torch.utils.data.Subset).")
        self._strategy.join_job()
        job_epoch, batch = divmod(self._strategy.current_step, self.num_batches)
        return int(job_epoch), int(batch)

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
        self._epoch = self.position_from(0, 0)[0]
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
            if yielded is not None and strategy.step_in_progress():
                raise user_error(
                    "FaultTolerantStrategy's batches are the job's steps: each one must end with the prepared "
                    "optimizer's step() (the commit vote) before the next one is taken",
                    f"a batch after the one of step {yielded}, whose step has not voted yet",
                    "Call optimizer.step() once per batch: several batches per update (a manual gradient "
                    "accumulation) are not built under FaultTolerantStrategy; take a larger global batch, or "
                    "accumulate under MirroredStrategy(gradient_accumulation_steps=k). An evaluation pass "
                    "(Trainer.evaluate, fit(validation_data=...)) is not supported under FaultTolerantStrategy yet: "
                    "evaluate under another strategy.",
                    cls=RuntimeError)
            strategy.begin_step()  # the quorum (and healing) first: it decides the split and the step
            step = strategy.current_step
            step_epoch, index = divmod(step, self.num_batches)
            if step_epoch != epoch:
                break  # healed past the epoch: the quorum stays open for the next iteration's first step
            indices = self._order(epoch)[index * self.global_batch_size:(index + 1) * self.global_batch_size]
            n, me = strategy.live_replicas, strategy.replica_id
            lo, hi = shard_bounds(len(indices), n, me, self._unit)
            padding = 1 if hi == lo and self._pad else 0
            # An empty share (fewer examples than replicas): the batch's first example, either as a zero-weight
            # padding example (pad_empty_batches) or for the batch's structure only (0 rows), as distribute_dataset does.
            rows = indices[:1] if hi == lo else indices[lo:hi]
            batch = self._source.fetch(rows)
            if hi == lo and not padding:
                batch = map_tensors(batch, lambda t: t[:0])
            yielded = step
            start = index * self.global_batch_size
            # The other groups' shares of this step: a commit here proves them in the update, also when their group
            # is lost before it records them (the ledger's "seen" lines).
            peers = tuple((start + a, start + b) for a, b in (shard_bounds(len(indices), n, r, self._unit) for r in range(n)
                                                              if r != me) if b > a)
            yield attach_batch_info(to_device(batch, strategy.device), BatchInfo(
                index=index, num_batches=self.num_batches, global_batch_size=len(indices), local_batch_size=hi - lo,
                num_padding_examples=padding, examples_per_update=len(indices), batches_per_update=1,
                last_in_update=True, epoch=epoch,
                rows=(start + lo, start + hi), peer_rows=peers,
                position=JobPosition(epoch, index, committed=partial(_committed, strategy, step))))
        self._epoch = max(epoch, strategy.current_step // self.num_batches)
