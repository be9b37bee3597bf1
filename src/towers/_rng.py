"""Each replica's own random stream: one seed for the script, a stream of its own for each replica's steps.

The script seeds once (``torch.manual_seed(0)``) and builds its model: every replica draws the same
initial weights. From its first step on, replica 0 keeps that stream (one process trains exactly as
the plain loop would) and every other replica forks its own, derived from the stream's state and the
replica's place: dropout masks and other draws differ between replicas, as they would between the
examples of one device's batch, and are the same run to run. A replica that resumes a checkpoint
written by fewer replicas forks the saved stream it reuses the same way; a script that seeds again
(``torch.manual_seed`` between epochs) gets every replica's stream forked again at the next step.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Mapping, Sequence

import numpy as np
import torch

__all__ = ["fork_replica_stream", "owns_stream", "replica_rng_state"]

# A forked seed says whose it is: this tag, the replica, 32 bits of the digest. So a replica sees at once whether
# the stream it draws from is its own (forked, or restored from its own checkpoint) or the script's (seeded again).
_TAG = 0x7057


def _tag(replica_id: int) -> int:
    return (_TAG << 16) | (int(replica_id) & 0xFFFF)


def owns_stream(replica_id: int) -> bool:
    """True when torch's stream was forked for ``replica_id`` (not the script's own seed, nor another replica's)."""
    return torch.initial_seed() >> 32 == _tag(replica_id)


def fork_replica_stream(replica_id: int) -> int:
    """Reseed torch (CPU and CUDA), numpy and ``random`` from the current torch stream and ``replica_id``; return the seed.

    Deterministic: the same stream state and replica give the same seed, on every run.
    """
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes() + int(replica_id).to_bytes(8, "little"),
                             digest_size=4).digest()
    seed = (_tag(replica_id) << 32) | int.from_bytes(digest, "little")
    torch.manual_seed(seed)  # seeds every CUDA device too
    np.random.seed(seed % 2**32)
    random.seed(seed)
    return seed


def replica_rng_state(saved: Sequence[Mapping[str, Any]], replica_id: int) -> dict[str, Any]:
    """The RNG state replica ``replica_id`` resumes with from a checkpoint's per-replica ``saved`` states.

    Its own when the checkpoint has one; otherwise replica ``replica_id % len(saved)``'s, marked to be
    forked for this replica once it is set (``"fork"``), so that no two replicas share a stream.
    """
    state = dict(saved[replica_id % len(saved)])
    if replica_id >= len(saved):
        state["fork"] = int(replica_id)
    return state
