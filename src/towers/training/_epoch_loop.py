"""The Trainer's epochs: the training input, where each epoch starts (a resumed or joined job), the step loop."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterator, Sized, cast

from torch.utils.data import Dataset

from towers._logging import get_logger
from towers.checkpoint.state import set_rng_state
from towers.data import BatchInfo, DistributedBatches, find_batch_info, global_batch_sizes, is_stream
from towers.errors import FailedPreconditionError, user_error
from towers.training._metric_sync import MetricSync
from towers.training._state import TrainingProgress
from towers.training._step_runner import StepRunner
from towers.training._stop_decision import StopDecision
from towers.training.callbacks.base import CallbackList

if TYPE_CHECKING:
    from towers.training.trainer import Trainer

__all__ = ["EpochLoop"]

log = get_logger(__name__)


class EpochLoop:
    """A fit's epochs: its training input (``train_input``, made once per fit), where each epoch starts, and the
    loop over an epoch's steps.

    Moves ``trainer``'s public state as the steps go (``progress``, ``stop_training``, ``joined_job``,
    ``step_batch_info``, ``throughput``); is handed the step it runs (``steps``), the training metrics' sums it
    reduces (``metrics``) and the stop decision (``stop``).
    """

    def __init__(self, trainer: Trainer, steps: StepRunner, metrics: MetricSync, stop: StopDecision):
        self.trainer = trainer
        self.steps = steps
        self.metrics = metrics
        self.stop = stop
        #: The distributed training input of the current (or last) fit, as ``strategy.distribute_dataset`` made it.
        self.train_input: Any = None
        self._train_set: Dataset | None = None
        self._global_batch_size = 0
        self._shuffle = True
        self._steps_per_epoch: int | None = None

    def start(self, train_set: Dataset, global_batch_size: int, *, shuffle: bool, steps_per_epoch: int | None) -> None:
        """A fit starts on ``train_set``: its input is made at its first epoch."""
        self.train_input = None
        self._train_set, self._global_batch_size = train_set, global_batch_size
        self._shuffle, self._steps_per_epoch = shuffle, steps_per_epoch

    @property
    def _data(self) -> Dataset:
        if self._train_set is None:
            raise FailedPreconditionError("EpochLoop.start was not called: the epoch loop has no training data")
        return self._train_set

    def run(self, callbacks: CallbackList, rng: Any) -> None:
        """Train the epoch the trainer's ``progress`` is in, from its step; ``rng``: the RNG state to restore
        (a resume's), or None."""
        t = self.trainer
        p = t.progress
        steps_per_epoch = self._steps_per_epoch
        self.metrics.begin_epoch(fresh=p.step == 0)  # a mid-epoch resume keeps the restored running sums
        if p.step == 0 and rng is not None:  # saved at an epoch boundary: before this epoch built its iterator
            set_rng_state(rng)
            rng = None
        it = self._epoch_iterator(callbacks, p.epoch, p.step)
        batches = self.train_input
        # Decided once per epoch, not per step: isinstance on a runtime-checkable Protocol costs tens of microseconds.
        counted = batches if isinstance(batches, DistributedBatches) else None
        syncing_is_free = self.syncing_is_free
        if rng is not None:
            # Saved mid-epoch, after the iterator was built (which may draw from the RNGs): restore
            # only once this run's iterator is built and positioned.
            set_rng_state(rng)
        for batch_index, batch in enumerate(it, start=p.step):
            info = find_batch_info((batch,))
            position = info.position if info is not None else None
            if position is not None and (position.epoch, position.step) != (p.epoch, p.step):
                # The input's position is the job's, and the job went on without this replica (a group that
                # healed to the live groups' step). A retried step has the same position: nothing moves.
                t.progress = p = self._progress_at(position.epoch, position.step)
            batch_index = p.step
            if steps_per_epoch is not None and batch_index >= steps_per_epoch:
                break
            callbacks.call("on_train_batch_begin", batch_index, {})
            with t.throughput.step(batch):
                size, sums = self.steps.run(batch, info)
                t.step_batch_info = info
            if position is not None and not position.committed():
                # Not committed (a group was lost mid-step): its update was dropped on every live group, which
                # all retry the same global batch next. It counts nowhere: no examples, metric sums or logs.
                continue
            t.progress = p = p.after_step(size)
            self.metrics.add(sums)
            # Collectives only at every log_every_n_steps-th step of the epoch (its first included) and at its
            # last step: in between, the logs hold the values of the last synchronisation. The step's place in
            # the epoch decides, so a replica that joined a running job reduces at the same steps.
            sync = (batch_index % t.log_every_n_steps == 0
                    or _last_of_epoch(info, batch_index, counted, steps_per_epoch)
                    or (not self.metrics.last_logs and not t.joined_job)  # a resumed epoch's first logs
                    or syncing_is_free)
            logs = self.metrics.sync(p.global_step) if sync else dict(self.metrics.last_logs)
            logs.update({"size": float(size), "examples": p.examples, "global_step": p.global_step})
            callbacks.call("on_train_batch_end", batch_index, logs)
            if sync:
                t.stop_training = self.stop.any_replica(t.stop_training, p.global_step)
                self.metrics.warn_nonfinite(logs, stopping=t.stop_training)
                if t.stop_training:
                    break
        self.metrics.sync(t.progress.global_step)  # the epoch's sums are complete before its logs are read

    @property
    def syncing_is_free(self) -> bool:
        """One replica on the CPU: reducing is free, so every step's logs are exact. On a GPU, reading the sums
        every step would make the host wait for the device's queue at each step."""
        strategy = self.trainer.strategy
        return strategy.num_replicas_in_sync == 1 and strategy.device.type == "cpu"

    def examples(self) -> int:
        """The examples this epoch trained on: as the input counted them, else its global batches'."""
        batches = self.train_input
        counted = batches.examples_trained if isinstance(batches, DistributedBatches) else None
        if counted is not None:
            return int(counted)
        train_set, progress = self._data, self.trainer.progress
        if is_stream(train_set):
            return progress.examples  # every global batch of a stream is counted as it is trained
        return sum(global_batch_sizes(len(cast(Sized, train_set)), self._global_batch_size)[:progress.step])

    def _input(self, callbacks: CallbackList) -> Any:
        """The strategy's distributed training input of this fit (made on first use)."""
        if self.train_input is None:
            t = self.trainer
            self.train_input = t.strategy.distribute_dataset(self._data, self._global_batch_size, shuffle=self._shuffle,
                                                             seed=t.seed, drop_remainder=False)
            if isinstance(self.train_input, DistributedBatches):  # shares handed out at run time: recorded there
                from towers.training.callbacks.ledger import ExampleLedger

                self.train_input.in_ledger = any(isinstance(cb, ExampleLedger) for cb in callbacks)
        return self.train_input

    def follow_job(self, callbacks: CallbackList) -> None:
        """At an epoch's start, go where the input says the next batch is (``position_from``).

        That is where the Trainer is, except for an input whose position is the job's: a replica
        group that joined a running job (started again after a failure, fault tolerance) so
        continues in the job's epoch at the job's step, as the live groups do; ``initial_epoch`` and
        a restored position give way to the job's.
        """
        batches = self._input(callbacks)
        if not isinstance(batches, DistributedBatches):
            return
        t, steps_per_epoch = self.trainer, self._steps_per_epoch
        p = t.progress
        epoch, step = batches.position_from(p.epoch, p.step, steps_per_epoch=steps_per_epoch)
        if (epoch, step) == (p.epoch, p.step):
            return
        if epoch < p.epoch and steps_per_epoch is not None:
            # The input did not end the epoch steps_per_epoch ended: going back to it would loop forever. (Without
            # steps_per_epoch, going back is the job's: an initial_epoch ahead of it gives way.)
            raise user_error("The training input's position is behind the epoch this fit is in",
                             f"the input's epoch {epoch}, step {step}; the fit's epoch {p.epoch}, "
                             f"steps_per_epoch={steps_per_epoch}",
                             "Its epochs are the job's passes over the whole dataset: leave steps_per_epoch=None.")
        t.joined_job = True
        t.progress = self._progress_at(epoch, step)
        log.info("following the job: epoch %d, step %d (this replica was at epoch %d, step %d)",
                 epoch, step, p.epoch, p.step)

    def _progress_at(self, epoch: int, step: int) -> TrainingProgress:
        """The progress at the job's ``(epoch, step)`` of a map-style dataset: ``step`` global batches into ``epoch``."""
        size, global_batch_size = len(cast(Sized, self._data)), self._global_batch_size
        per_epoch = math.ceil(size / global_batch_size)  # the Trainer keeps the last, partial global batch
        return dataclasses.replace(self.trainer.progress, epoch=epoch, step=step,
                                   examples=min(step * global_batch_size, size), global_step=epoch * per_epoch + step)

    def _epoch_iterator(self, callbacks: CallbackList, epoch: int, start: int) -> Iterator[Any]:
        # An epoch's order is fixed by (seed, epoch), independent of the replica count, so a resumed
        # run starts at batch `start` of the same order.
        batches = self._input(callbacks)
        if isinstance(batches, DistributedBatches):
            batches.set_epoch(epoch)  # order: seed + epoch
            return iter(batches.iter_from(start))
        # A strategy whose datasets know no epochs: a new one per epoch, seeded with seed + epoch
        t = self.trainer
        batches = self.train_input = t.strategy.distribute_dataset(
            self._data, self._global_batch_size, shuffle=self._shuffle, seed=t.seed + epoch, drop_remainder=False)
        it = iter(batches)
        for _ in range(start):
            next(it, None)
        return it


def _last_of_epoch(info: BatchInfo | None, index: int, batches: DistributedBatches | None,
                   steps_per_epoch: int | None) -> bool:
    """True when step ``index`` (its batch carrying ``info``) is the epoch's last: ``steps_per_epoch`` ends it here,
    it is the last of the input's (``batches``) known number of batches, or (a stream, whose length is known only at
    its end) its accounting says so. Every replica decides the same: the collectives it starts stay paired."""
    if steps_per_epoch is not None and index + 1 >= steps_per_epoch:
        return True
    total = batches.batches_per_epoch if batches is not None else None
    if total is not None:
        return index + 1 == total
    # a stream's batches are split statically: the same index on every replica
    return info is not None and info.num_batches == info.index + 1
