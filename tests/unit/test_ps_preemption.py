"""A preemption notice on a process that serves the workers (a ps task) and on the ps supervisor.

One process plays both sides on one in-memory store (``torch.distributed.HashStore``, the
interface of the job's rendezvous store): the ps task's ``ServingPreemptionHandler`` takes SIGUSR2,
a worker's ``PreemptionHandler`` takes SIGUSR1, so both can be installed at once. The launches
that send real SIGTERMs are in tests/distributed/test_preemption.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from towers import cluster
from towers.checkpoint.preemption import PREEMPTED_EXIT_CODE, PreemptionHandler, ServingPreemptionHandler
from towers.launch.supervise import decide


@pytest.fixture
def handlers():
    store = dist.HashStore()
    ps = ServingPreemptionHandler(signals=[signal.SIGUSR2], store=store, rank=2, boundary_timeout_s=1.0)
    worker = PreemptionHandler(signals=[signal.SIGUSR1], store=store, rank=0)
    ps.install()
    worker.install()
    yield ps, worker
    worker.uninstall()
    ps.uninstall()


def test_a_notice_to_the_ps_task_makes_the_workers_save_and_the_ps_task_exit_for_a_restart(handlers):
    ps, worker = handlers
    assert not worker.should_save(4) and ps.agreed_step() is None
    os.kill(os.getpid(), signal.SIGUSR2)  # handled at once: the signal is for this process
    assert ps.noticed == signal.SIGUSR2 and worker.noticed is None
    assert not worker.should_save(5)  # the worker learns of it through the store and proposes the next step
    assert ps.agreed_step() == 6
    deadline = time.monotonic() + 10
    while ps.decided_step is None and time.monotonic() < deadline:  # the ps task's timer found the agreement
        time.sleep(0.01)
    assert ps.decided_step == 6  # ... and did not end the process, as it would without one
    os.kill(os.getpid(), signal.SIGUSR2)  # a second notice once they agreed: serving on, the save needs it
    assert ps.installed
    assert worker.should_save(6)
    assert ps.finish() == 6 and not ps.installed  # exit with PREEMPTED_EXIT_CODE; the notice is not delivered again


def test_the_ps_task_exits_for_a_restart_after_a_notice_to_a_worker_too(handlers):
    ps, worker = handlers
    os.kill(os.getpid(), signal.SIGUSR1)
    assert worker.should_save(3) is False and worker.should_save(4) is True
    assert ps.noticed is None and ps.finish() == 4


def test_without_a_save_the_ps_task_exits_as_before(handlers):
    ps, _ = handlers
    assert ps.finish() is None  # no notice: exit code 0
    received = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: received.append(signum))
    try:
        again = ServingPreemptionHandler(signals=[signal.SIGUSR2], store=dist.HashStore(), boundary_timeout_s=60)
        again.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert again.finish() is None  # nobody saved: the notice goes to the previous handler, not swallowed
        assert received == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def ps_job_info(rank: int) -> cluster.ProcessInfo:
    return cluster.from_env({"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TOWERS_STRATEGY": "ps",
                             "TOWERS_NUM_PS": "1"})


def test_the_supervisor_passes_a_preempted_workers_exit_on_so_the_job_restarts():
    decision = decide(ps_job_info(1), PREEMPTED_EXIT_CODE)  # a non-chief worker that saved on a notice
    assert not decision.tolerated and decision.exit_code == PREEMPTED_EXIT_CODE
    assert decide(ps_job_info(2), PREEMPTED_EXIT_CODE).exit_code == PREEMPTED_EXIT_CODE  # the ps task
    assert decide(ps_job_info(1), 3).tolerated  # any other failure of that worker is still tolerated
