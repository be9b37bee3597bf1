"""The Trainer's epochs: the training input, where each epoch starts (a resumed or joined job), the step loop."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Sized, cast

from torch.utils.data import Dataset

from towers._logging import get_logger
from towers.checkpoint.state import set_rng_state
from towers.data import DistributedBatches, FollowsJob, find_batch_info, global_batch_sizes, is_stream
from towers.errors import user_error
from towers.training._state import TrainingProgress
from towers.training._trainer_attributes import TrainerAttributes

log = get_logger(__name__)


class _Epochs(TrainerAttributes):
    """The Trainer's epochs: its training input (made once per fit), where each epoch starts, and the step loop.

    A base class of ``Trainer``: its state is the Trainer's.
    """

    def _train_epoch(self, train_set: Dataset, global_batch_size: int, steps_per_epoch: int | None,
                     shuffle: bool, rng: Any) -> None:
        p = self.progress
        self._unsynced = None
        if p.step == 0:  # a fresh epoch (a mid-epoch resume keeps the restored running sums)
            self._train_metrics.reset()
            self._last_train_logs = {}
            if rng is not None:  # saved at an epoch boundary: before this epoch built its iterator
                set_rng_state(rng)
                rng = None
        it = self._epoch_iterator(train_set, global_batch_size, shuffle, p.epoch, p.step)
        batches = self._train_batches
        if isinstance(batches, DistributedBatches):
            batches.last_pass = None  # set again when this epoch's pass completes (parameter servers)
        job = batches if isinstance(batches, FollowsJob) else None
        if rng is not None:
            # Saved mid-epoch, after the iterator was built (which may draw from the RNGs): restore
            # only once this run's iterator is built and positioned.
            set_rng_state(rng)
        for batch_index, batch in enumerate(it, start=p.step):
            if job is not None:  # the job's step: a step retried after one that did not commit has its index
                self.progress = p = self._job_progress(train_set, global_batch_size, *job.job_position())
                batch_index = p.step
            if steps_per_epoch is not None and batch_index >= steps_per_epoch:
                break
            self._callbacks.call("on_train_batch_begin", batch_index, {})
            with self.throughput.step(batch):
                size, sums = self._train_step(batch)
            if job is None:
                self.progress = p = p.after_step(size)
            else:
                after = self._job_progress(train_set, global_batch_size, *job.job_position(), within=p.epoch)
                if after == p:
                    # Not committed (a group was lost mid-step): its update was dropped on every live group, which
                    # all retry the same global batch next. It counts nowhere: no examples, metric sums or logs.
                    continue
                self.progress = p = after
            self._unsynced = sums if self._unsynced is None else self._unsynced + sums
            # Collectives only at every log_every_n_steps-th step of the epoch (its first included) and at its
            # last step: in between, the logs hold the values of the last synchronisation. The step's place in
            # the epoch decides, so a replica that joined a running job (FollowsJob) reduces at the same steps.
            sync = (batch_index % self.log_every_n_steps == 0
                    or _last_of_epoch(batch, batch_index, batches, steps_per_epoch)
                    or (not self._last_train_logs and job is None)  # a resumed epoch's first logs
                    or self._syncing_is_free)
            logs = self._sync_train_metrics() if sync else dict(self._last_train_logs)
            logs.update({"size": float(size), "examples": p.examples, "global_step": p.global_step})
            self._callbacks.call("on_train_batch_end", batch_index, logs)
            if sync:
                self.stop_training = self._any_replica(self.stop_training)
                self._warn_nonfinite(logs)
                if self.stop_training:
                    break
        self._sync_train_metrics()  # the epoch's sums are complete before its logs are read

    @property
    def _syncing_is_free(self) -> bool:
        """One replica on the CPU: reducing is free, so every step's logs are exact. On a GPU, reading the sums
        every step would make the host wait for the device's queue at each step."""
        return self.strategy.num_replicas_in_sync == 1 and self.strategy.device.type == "cpu"

    def _epoch_examples(self, train_set: Dataset, global_batch_size: int) -> int:
        """The examples this epoch trained on: as the parameter servers counted them, else its global batches'."""
        batches = self._train_batches
        counted = batches.last_pass if isinstance(batches, DistributedBatches) else None
        if counted is not None:
            if counted["examples"] != counted["expected"]:
                log.warning("epoch %d trained on %d of its %d examples", self.progress.epoch, counted["examples"],
                            counted["expected"])
            return int(counted["examples"])
        if is_stream(train_set):
            return self.progress.examples  # every global batch of a stream is counted as it is trained
        return sum(global_batch_sizes(len(cast(Sized, train_set)), global_batch_size)[:self.progress.step])

    def _train_input(self, train_set: Dataset, global_batch_size: int, shuffle: bool) -> Any:
        """The strategy's distributed training input of this fit (made on first use)."""
        if self._train_batches is None:
            self._train_batches = self.strategy.distribute_dataset(train_set, global_batch_size, shuffle=shuffle,
                                                                   seed=self.seed, drop_remainder=False)
            if hasattr(self._train_batches, "in_ledger"):  # handed out at run time: ps task 0 records what it applied
                from towers.training.callbacks.ledger import ExampleLedger

                self._train_batches.in_ledger = any(isinstance(cb, ExampleLedger) for cb in self._callbacks)
        return self._train_batches

    def _follow_job(self, train_set: Dataset, global_batch_size: int, shuffle: bool,
                    steps_per_epoch: int | None) -> None:
        """At an epoch's start, take the epoch and step from an input whose position is the job's (``FollowsJob``).

        A replica group that joined a running job (started again after a failure, fault tolerance)
        so continues in the job's epoch at the job's step, as the live groups do; ``initial_epoch``
        and a restored position give way to the job's.

        Raises:
            ValueError: ``steps_per_epoch`` shorter than the input's epoch (the job's epochs are whole passes).
        """
        batches = self._train_input(train_set, global_batch_size, shuffle)
        if not isinstance(batches, FollowsJob):
            return
        per_epoch = math.ceil(len(cast(Sized, train_set)) / global_batch_size)
        if steps_per_epoch is not None and steps_per_epoch < per_epoch:
            raise user_error(f"steps_per_epoch must cover the whole dataset under {type(self.strategy).__name__}, "
                             f"whose epochs are the job's passes over it ({per_epoch} steps)",
                             f"steps_per_epoch={steps_per_epoch}",
                             "Leave steps_per_epoch=None, or pass a smaller dataset (e.g. a torch.utils.data.Subset).")
        p = self.progress
        self.progress = self._job_progress(train_set, global_batch_size, *batches.job_position())
        if (self.progress.epoch, self.progress.step) != (p.epoch, p.step):
            log.info("following the job: epoch %d, step %d (this replica was at epoch %d, step %d)",
                     self.progress.epoch, self.progress.step, p.epoch, p.step)

    def _job_progress(self, train_set: Dataset, global_batch_size: int, epoch: int, step: int, *,
                      within: int | None = None) -> TrainingProgress:
        """The progress at the job's ``(epoch, step)``; ``within``: clamped to the end of that epoch."""
        size = len(cast(Sized, train_set))
        per_epoch = math.ceil(size / global_batch_size)  # the Trainer keeps the last, partial global batch
        if within is not None and epoch > within:  # the step committed was the epoch's last
            epoch, step = within, per_epoch
        return dataclasses.replace(self.progress, epoch=epoch, step=step, examples=min(step * global_batch_size, size),
                                   global_step=epoch * per_epoch + step)

    def _epoch_iterator(self, train_set: Dataset, global_batch_size: int, shuffle: bool, epoch: int,
                        start: int) -> Iterator[Any]:
        # An epoch's order is fixed by (seed, epoch), independent of the replica count, so a resumed
        # run starts at batch `start` of the same order.
        batches = self._train_input(train_set, global_batch_size, shuffle)
        if isinstance(batches, DistributedBatches):
            batches.set_epoch(epoch)  # order: seed + epoch
            return iter(batches.iter_from(start))
        # A strategy whose datasets know no epochs: a new one per epoch, seeded with seed + epoch
        batches = self._train_batches = self.strategy.distribute_dataset(
            train_set, global_batch_size, shuffle=shuffle, seed=self.seed + epoch, drop_remainder=False)
        it = iter(batches)
        for _ in range(start):
            next(it, None)
        return it


def _last_of_epoch(batch: Any, index: int, batches: Any, steps_per_epoch: int | None) -> bool:
    """True when step ``index`` (this batch) is the epoch's last: ``steps_per_epoch`` ends it here, it is the
    last of the dataset's known number of batches, or (a stream, whose length is known only at its end) its
    accounting says so. Every replica decides the same: the collectives it starts stay paired."""
    if steps_per_epoch is not None and index + 1 >= steps_per_epoch:
        return True
    total = batches.batches_per_epoch if isinstance(batches, DistributedBatches) else None
    if total is not None:
        return index + 1 == total
    info = find_batch_info((batch,))  # a stream's batches are split statically: the same index on every replica
    return info is not None and info.num_batches == info.index + 1
