"""FaultTolerantBatches, the Trainer's input under FaultTolerantStrategy, on a stand-in for the strategy (no torchft)."""

from __future__ import annotations

import pytest
import torch

from towers.data import DistributedBatches, batch_info
from towers.strategies.fault_tolerant import FaultTolerantBatches


class _Job:
    """What FaultTolerantBatches asks of its strategy: the committed steps, the quorum of the step, its vote."""

    device = torch.device("cpu")

    def __init__(self, step: int, num_replicas: int = 2, replica_id: int = 0):
        self.current_step, self.live_replicas, self.replica_id = step, num_replicas, replica_id
        self.open, self.quorums, self.joined = False, 0, False

    def join_job(self) -> None:
        if not self.joined:
            self.begin_step()

    def begin_step(self) -> None:
        if not self.open:
            self.open, self.joined = True, True
            self.quorums += 1

    def step_in_progress(self) -> bool:
        return self.open

    def vote(self, committed: bool) -> None:
        self.open = False
        self.current_step += int(committed)


def _batches(job: _Job) -> FaultTolerantBatches:
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(10, 1), torch.arange(10))
    return FaultTolerantBatches(job, data, 4, shuffle=False, seed=0, drop_remainder=False,  # type: ignore[arg-type]
                                max_steps=None, collate_fn=None)  # 3 global batches per epoch: 4, 4, 2


def test_batches_are_the_jobs_steps():
    job = _Job(step=5)  # epoch 1, global batch 2
    batches = _batches(job)
    assert isinstance(batches, DistributedBatches)
    # Wherever the Trainer would go on, the next batch is the job's: joined first (a restarted group heals there) ...
    assert batches.position_from(0, 0) == (1, 2) and job.quorums == 1
    assert batches.position_from(0, 0) == (1, 2) and job.quorums == 1  # ... later: read, no quorum joined
    with pytest.raises(ValueError, match=r"steps_per_epoch must cover the whole dataset.*Received: steps_per_epoch=2"):
        batches.position_from(1, 2, steps_per_epoch=2)
    batches.set_epoch(1)
    steps = batches.iter_from(2)
    x, y = next(steps)
    info = batch_info(x)
    assert y.tolist() == [8] and info.index == 2 and info.global_batch_size == 2  # group 0's half
    assert (info.position.epoch, info.position.step) == (1, 2)
    job.vote(committed=False)
    assert not info.position.committed()  # the Trainer counts the step nowhere
    _, y = next(steps)  # not committed: the same global batch again, in a new quorum
    retried = batch_info(_)
    assert y.tolist() == [8] and job.quorums == 2 and retried.position == info.position
    job.vote(committed=True)
    assert retried.position.committed()
    assert next(steps, None) is None  # the job left epoch 1 ...
    assert job.quorums == 2 and batches.epoch == 2  # ... seen before joining the next step's quorum
    assert batches.state_dict()["epoch"] == 2 and batches.state_dict()["batch"] == 0


def test_a_batch_taken_before_the_previous_step_voted_is_refused():
    job = _Job(step=0, num_replicas=1)
    batches = _batches(job)
    steps = iter(batches)
    next(steps)
    with pytest.raises(RuntimeError, match=r"must end with the prepared optimizer's step\(\).*Received: a batch after "
                                           r"the one of step 0"):
        next(steps)  # an evaluation loop, or a step that forgot optimizer.step(): never the same batch forever


def test_each_share_names_the_other_groups_shares_of_its_step():
    """What the ledger records as seen: a commit proves the whole step's split, also of a group lost before recording."""
    job = _Job(step=1, num_replicas=3, replica_id=1)  # global batch 1 (positions 4..7) over 3 groups: 2, 1, 1
    x, _ = next(iter(_batches(job)))
    info = batch_info(x)
    assert info.rows == (6, 7) and info.peer_rows == ((4, 6), (7, 8))
    job = _Job(step=2, num_replicas=3, replica_id=0)  # the last global batch (positions 8, 9): the third share is empty
    x, _ = next(iter(_batches(job)))
    assert batch_info(x).rows == (8, 9) and batch_info(x).peer_rows == ((9, 10),)
    job = _Job(step=1, num_replicas=1)  # alone: nobody else's share
    x, _ = next(iter(_batches(job)))
    assert batch_info(x).rows == (4, 8) and batch_info(x).peer_rows == ()
