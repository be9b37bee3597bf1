"""A preemption notice under DiLoCo saves only where a window ends, at a step every worker agrees on.

Two workers' ``PreemptionHandler``s share one in-memory store (``torch.distributed.HashStore``, the
interface of the job's rendezvous store); ``can_save`` is what ``strategy.at_preemption_boundary()``
says at each step boundary (windows of 4 steps). The launch that preempts a real DiLoCo job and
resumes it is tests/distributed/test_diloco_preemption.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from towers.checkpoint.preemption import PreemptionHandler
from towers.strategies.parameter_server.diloco_state import DILOCO_KEY, split_diloco_state


@pytest.fixture
def workers():
    store = dist.HashStore()
    receiver = PreemptionHandler(signals=[signal.SIGUSR1], store=store, rank=1, boundary_timeout_s=0.5)
    other = PreemptionHandler(signals=[signal.SIGUSR2], store=store, rank=0)
    receiver.install()
    other.install()
    yield receiver, other
    other.uninstall()
    receiver.uninstall()


def _window_end(step: int) -> bool:
    return step % 4 == 0


def test_a_notice_mid_window_saves_where_that_window_ends_on_every_worker(workers):
    receiver, other = workers
    assert not other.should_save(5, can_save=False)
    os.kill(os.getpid(), signal.SIGUSR1)  # after step 5 of the window 5..8
    # the receiver proposes at its next boundary; nobody can be past step 8, whose outer step needs its push
    assert not receiver.should_save(6, can_save=_window_end(6)) and receiver.agreed_step() == 7
    assert receiver._timer is None  # the loop runs: the notice is not passed on while the window ends
    assert [s for s in range(6, 13) if other.should_save(s, can_save=_window_end(s))] == [8]
    assert [s for s in range(7, 13) if receiver.should_save(s, can_save=_window_end(s))] == [8]


def test_a_notice_read_from_the_store_at_a_window_end_saves_one_window_later(workers):
    receiver, other = workers
    os.kill(os.getpid(), signal.SIGUSR1)  # it came while this worker's outer push of step 8 was under way
    # the other worker read the store at step 8: a worker may already be in the next window, so it proposes 9
    assert not other.should_save(8, can_save=True) and other.agreed_step() == 9
    assert [s for s in range(8, 17) if receiver.should_save(s, can_save=_window_end(s))] == [12]
    assert [s for s in range(9, 17) if other.should_save(s, can_save=_window_end(s))] == [12]


def test_a_checkpoint_gives_each_worker_its_own_inner_state_and_the_outer_state_apart():
    def inner(value: float) -> dict:
        return {"state": {"w": {"exp_avg": torch.full((2,), value)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}

    outer = {"state": {"w": {"momentum_buffer": torch.ones(2)}}, "param_groups": [{"lr": 0.7, "params": ["w"]}]}
    saved = {"model": {"w": torch.zeros(2)}, "optimizer": {**inner(0.0), DILOCO_KEY: {"outer": outer,
                                                                                     "workers": [inner(0.0), inner(1.0)]}}}
    state, got_outer = split_diloco_state(saved, replica_id=1)
    assert got_outer is outer and DILOCO_KEY not in state["optimizer"]
    assert torch.equal(state["optimizer"]["state"]["w"]["exp_avg"], torch.ones(2))
    state, _ = split_diloco_state(saved, replica_id=2)  # a worker the checkpoint did not have: the chief's
    assert torch.equal(state["optimizer"]["state"]["w"]["exp_avg"], torch.zeros(2))
    plain = {"model": {}, "optimizer": inner(3.0)}  # a checkpoint of another mode loads as it is
    assert split_diloco_state(plain, replica_id=0) == (plain, None)
