"""Each replica's own random stream (towers._rng): forked from the script's seed and the replica's place, the same
run to run, kept when restored from the replica's own checkpoint, forked again for a replica the checkpoint lacked."""

from __future__ import annotations

import torch

from towers._rng import fork_replica_stream, owns_stream, replica_rng_state
from towers.checkpoint.state import rng_state, set_rng_state


def _draws_after_fork(replica: int) -> torch.Tensor:
    torch.manual_seed(0)
    torch.rand(3)  # the script drew its initial weights
    fork_replica_stream(replica)
    return torch.rand(4)


def test_a_forked_stream_is_the_replicas_own_and_the_same_run_to_run() -> None:
    one, again, other = _draws_after_fork(1), _draws_after_fork(1), _draws_after_fork(2)
    assert torch.equal(one, again)  # derived from the seed and the place: reproducible
    assert not torch.equal(one, other)  # replicas draw their own numbers
    torch.manual_seed(0)
    assert not torch.equal(one, torch.rand(4)) and not owns_stream(1)  # the script's seed is nobody's fork
    fork_replica_stream(1)
    assert owns_stream(1) and not owns_stream(2)


def test_a_resume_keeps_a_replicas_own_stream_and_forks_one_for_a_replica_it_did_not_have() -> None:
    saved = []
    for replica in (0, 1):  # a checkpoint written by 2 replicas: replica 0 on the script's stream, 1 on its fork
        torch.manual_seed(0)
        if replica:
            fork_replica_stream(replica)
        torch.rand(5)
        saved.append(rng_state())
    expected = [torch.rand(4)]  # replica 1 after its save, uninterrupted
    set_rng_state(replica_rng_state(saved, 1))
    assert owns_stream(1) and torch.equal(torch.rand(4), expected[0])  # its own stream, restored exactly
    streams = []
    for replica in (2, 3):  # replicas a 2-replica checkpoint did not have: saved r % 2, forked for r
        set_rng_state(replica_rng_state(saved, replica))
        assert owns_stream(replica)
        streams.append(torch.rand(4))
    set_rng_state(replica_rng_state(saved, 2))
    assert torch.equal(torch.rand(4), streams[0])  # the same fork on every resume
    assert not torch.equal(streams[0], streams[1])
