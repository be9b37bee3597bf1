"""A collective every replica must call, across the replica groups of a FaultTolerantStrategy, without processes:
two ``GroupAgreement``s (groups 0 and 1 of one process each) on a store like torchrun's agent's, one waiting in a
thread. The launched job is tests/distributed/test_chief_only_result.py's fault-tolerant case."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from towers.cluster.info import ProcessInfo
from towers.diagnostics.named import named_call
from towers.launch.job_end import JobEndView, job_failure_noted, note_job_complete
from towers.strategies._named import PartialCollectiveError
from towers.strategies.context import PeerLostError
from towers.strategies.fault_tolerant.agreement import GroupAgreement

OP, FIX = "Metric.result() of 'accuracy'", "Call result() on every replica and print on the chief."
_THREADS: list[threading.Thread] = []


@pytest.fixture
def job(tmp_path: Path) -> Any:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    left: list[int] = []

    def agreement(rank: int) -> GroupAgreement:
        info = ProcessInfo(rank=rank, world_size=2, local_world_size=2, master_port=store.port, agent_store=True,
                           launch_dir=str(tmp_path))
        return GroupAgreement(info, group=rank, group_size=1, job_end=JobEndView(info), timeout_s=20.0,
                              peer_timeout_s=1.0, leave=lambda: left.append(rank))

    yield agreement, store, tmp_path, left
    for thread in _THREADS:  # before the store's server goes: a client blocked in it would abort the process
        thread.join(30)
    _THREADS.clear()


def _call_in_thread(agreement: GroupAgreement, step: int = 3) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def caller() -> None:
        with named_call(OP, FIX):
            try:
                agreement.agree(step=step, expected=2)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    _THREADS.append(thread)
    return thread, errors


def _published(store: Any) -> None:
    store.wait(["towers/attempt_0/ft/named/waiting"], timedelta(seconds=10))


def test_a_group_that_goes_on_ends_the_call_on_both_groups_and_notes_the_jobs_failure(job: Any) -> None:
    agreement, store, launch_dir, left = job
    thread, errors = _call_in_thread(agreement(0))
    _published(store)
    with pytest.raises(PartialCollectiveError) as missing:
        agreement(1).check(step=4, where="began the job's next step")
    thread.join(10)
    assert "[rank 1/2] Metric.result() of 'accuracy' was called on rank 0" in str(missing.value)
    assert "but not on rank 1 (this rank), which went on and began the job's next step" in str(missing.value)
    assert len(errors) == 1 and isinstance(errors[0], PartialCollectiveError), errors
    assert "but not on rank 1, which went on and began the job's next step" in str(errors[0]) and FIX in str(errors[0])
    assert "not called by every replica group" in (job_failure_noted(str(launch_dir)) or "")  # no restart for it
    assert left == []  # the other group looked itself: nobody waits for a quorum


def test_a_group_that_went_on_before_the_call_was_published_is_found_by_the_caller(job: Any) -> None:
    """Group 1 began its next step (and waits in its quorum, which the lighthouse does not form while group 0 lives)
    before group 0 entered result(): group 0 finds it, writes the verdict and leaves; group 1 then looks again."""
    agreement, store, launch_dir, left = job
    other = agreement(1)
    other.check(step=3, where="began the job's next step")  # nothing waits yet: on into the quorum
    thread, errors = _call_in_thread(agreement(0))
    store.wait(["towers/attempt_0/ft/named/3/1/end"], timedelta(seconds=10))
    assert left == [0]  # group 0 left the lighthouse: group 1's quorum forms without it
    with pytest.raises(PartialCollectiveError) as missing:
        other.check(step=4, where="began the job's next step")
    thread.join(10)
    assert "but not on rank 1 (this rank), which went on and began the job's next step" in str(missing.value)
    assert len(errors) == 1 and isinstance(errors[0], PartialCollectiveError), errors
    assert "but not on rank 1, which went on and began the job's next step (after 3 committed) in replica group 1" \
        in str(errors[0])


def test_every_group_in_the_call_goes_on_and_a_later_step_finds_nothing(job: Any) -> None:
    agreement, store, launch_dir, left = job
    first, second = agreement(0), agreement(1)
    thread, errors = _call_in_thread(first)
    _published(store)
    with named_call(OP, FIX):
        second.agree(step=3, expected=2)
    thread.join(10)
    assert errors == [] and not thread.is_alive()
    first.check(step=4, where="began the job's next step")  # the call is over: nothing to tell
    second.check(step=4, where="began the job's next step")
    assert job_failure_noted(str(launch_dir)) is None


def test_a_group_whose_script_ended_ends_the_caller_with_the_error(job: Any) -> None:
    agreement, _, launch_dir, left = job
    note_job_complete(ProcessInfo(launch_dir=str(launch_dir)), 1)  # group 1's supervisor: its processes exited 0
    with named_call(OP, FIX), pytest.raises(PartialCollectiveError) as error:
        agreement(0).agree(step=3, expected=2)
    assert "but not on rank 1, which went on and ended (its script finished or failed: replica group 1)" in \
        str(error.value)


def test_a_group_started_again_while_the_call_waits_makes_it_a_lost_peer(job: Any) -> None:
    agreement, store, launch_dir, left = job
    thread, errors = _call_in_thread(agreement(0))
    _published(store)
    agreement(1).lost()  # its first step after a restart: it cannot take part in the call
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], PeerLostError), errors
    assert "replica group 1 was lost and started again meanwhile" in str(errors[0])
    assert job_failure_noted(str(launch_dir)) is None  # a lost group is restarted as ever
