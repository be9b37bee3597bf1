"""The Trainer's throughput logs: its ``ThroughputMeter``'s epoch, as the chief measured it, on every replica."""

from __future__ import annotations

import math

import torch

from towers.diagnostics.throughput import THROUGHPUT_KEYS, ThroughputMeter
from towers.strategies.base import PeerLostError, Strategy

__all__ = ["epoch_throughput"]


def epoch_throughput(meter: ThroughputMeter, strategy: Strategy) -> dict[str, float]:
    """Return the epoch's ``examples_per_second``, ``tokens_per_second`` and ``mfu`` as the chief measured them.

    Call on every replica at the end of an epoch's training steps: with several replicas, one small
    ``reduce`` gives every replica the chief's values (its wall clock), so every History holds the
    same numbers. When a peer was lost meanwhile (``PeerLostError``), each keeps its own.
    """
    logs = meter.summary(synchronize=True)
    if strategy.num_replicas_in_sync == 1:
        return logs
    values = [logs.get(key, math.nan) if strategy.is_chief else 0.0 for key in THROUGHPUT_KEYS]
    try:
        reduced = strategy.reduce("sum", torch.tensor(values, dtype=torch.float64, device=strategy.device))
    except PeerLostError:
        return logs
    return {key: value for key, value in zip(THROUGHPUT_KEYS, reduced.cpu().tolist()) if math.isfinite(value)}
