"""The step identity a gradient all-reduce carries: what each replica ran, read back exactly from the SUM."""

from __future__ import annotations

import pytest
import torch

from towers.data import BatchInfo, DistributedDataset, batch_info
from towers.strategies._collectives import MismatchedStepsError
from towers.strategies._step_check import SLOT, StepCheck
from towers.strategies._steps import StepTracker


def _batch(epoch: int, index: int) -> BatchInfo:
    return BatchInfo(index, 8, 16, 8, 0, 16, 1, True, epoch=epoch)


def _summed(ran: list[tuple[int, int] | None], dtype: torch.dtype) -> tuple[list[StepCheck], list, list[float]]:
    """What each of len(ran) replicas folds in for its step, and the all-reduce's SUM of them (in ``dtype``)."""
    checks, identities, total = [], [], torch.zeros(len(ran) * SLOT, dtype=dtype)
    for rank, step in enumerate(ran):
        tracker = StepTracker()
        check = StepCheck(tracker, rank=rank, num_replicas=len(ran))
        tracker.begin_run(None if step is None else _batch(*step))
        identity, mark = check.mark(dtype, torch.device("cpu"))
        checks.append(check)
        identities.append(identity)
        total += mark
    return checks, identities, total.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_replicas_in_step_pass_and_every_replica_names_the_odd_one_even_in_half_precision(dtype):
    checks, identities, total = _summed([(2, 70_000)] * 3, dtype)
    for check, identity in zip(checks, identities):
        check.compare(identity, total)  # the same step everywhere: nothing raised
    checks, identities, total = _summed([(2, 5), (2, 6), (2, 5)], dtype)
    for rank, (check, identity) in enumerate(zip(checks, identities)):  # also the middle rank, whose value is not the mean
        with pytest.raises(MismatchedStepsError) as raised:
            check.compare(identity, total)
        message = str(raised.value)
        assert message.startswith(f"[rank {rank}/3] The replicas are out of step"), message
        if rank == 1:
            assert "is for epoch 2, global batch 6, but rank 0 ran epoch 2, global batch 5; rank 2 ran epoch 2, " \
                   "global batch 5." in message, message
        else:
            assert "is for epoch 2, global batch 5, but rank 1 ran epoch 2, global batch 6." in message, message


def test_steps_without_accounting_are_left_to_the_step_counts_unless_mixed_with_accounted_ones():
    checks, identities, total = _summed([None, None], torch.float32)
    for check, identity in zip(checks, identities):
        check.compare(identity, total)
    checks, identities, total = _summed([(0, 1), None], torch.float32)
    with pytest.raises(MismatchedStepsError, match="rank 1 ran a batch without accounting"):
        checks[0].compare(identities[0], total)


def test_micro_batches_since_the_last_update_are_part_of_the_identity():
    tracker = StepTracker(2)
    check = StepCheck(tracker, rank=0, num_replicas=1)
    for index in (0, 0, 1):  # a micro-batch run twice in the window
        tracker.begin_run(BatchInfo(index, 4, 16, 16, 0, 32, 2, index == 1))
    identity, _ = check.mark(torch.float32, torch.device("cpu"))
    assert (identity.index, identity.micro_batches) == (1, 3)
    assert identity.describe() == "epoch 0, global batch 1 after 3 micro-batch(es) since its last update"


def test_every_batch_carries_its_epoch():
    dataset = DistributedDataset(torch.arange(8.0), 4, shuffle=False)
    assert [(batch_info(b).epoch, batch_info(b).index) for _ in range(2) for b in dataset] == [(0, 0), (0, 1), (1, 0), (1, 1)]
