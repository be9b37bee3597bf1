"""The catalogue of reasons a distributed run is not the one-process run, each matched against the evidence.

Causes are tried in order; the first whose test holds is named. Refusals (towers' own errors, which
already name the fix) come first, then what the parameters and the recorded calls show.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from towers.verify.compare import Evidence

__all__ = ["Cause", "CAUSES", "name_cause"]


@dataclass(frozen=True)
class Cause:
    """One known reason: a short ``key``, what it means and the fix, and the test that recognises it.

    Attributes:
        key: a short name, e.g. ``"loss-not-global"``.
        title: what it means, one line.
        fix: how to fix it.
        test: whether a run's ``Evidence`` shows this cause.
    """

    key: str
    title: str
    fix: str
    test: Callable[[Evidence], bool]


def _error(pattern: str) -> Callable[[Evidence], bool]:
    regex = re.compile(pattern, re.IGNORECASE | re.DOTALL)
    return lambda e: e.error is not None and regex.search(e.error) is not None


def _near(value: float | None, target: float, tolerance: float = 0.05) -> bool:
    return value is not None and abs(value - target) <= tolerance * target


def _diverged(e: Evidence) -> bool:
    return e.difference is not None


def _at_start(e: Evidence) -> bool:
    return e.difference is not None and e.difference.step == 0


def _drift(e: Evidence) -> bool:
    return e.replica_drift_step is not None and e.replica_drift_step > 0


def _whole_batch(e: Evidence) -> bool:
    ref, mine = e.reference_examples, e.replica_examples
    return e.replicas > 1 and _diverged(e) and bool(ref) and bool(mine) and mine[0] == ref[0] and ref[0] > 1


def _same_examples(e: Evidence) -> bool:
    return e.replicas > 1 and _diverged(e) and e.same_examples_on_replicas


def _own_random_batches(e: Evidence) -> bool:
    # From the first update the replicas' examples, together, are not one process's, and not all the same ones:
    # each replica drew its own (a ragged last batch differs only at its end: uneven-last-batch).
    return e.replicas > 1 and _diverged(e) and not e.same_examples_on_replicas and e.first_update_as_one_process is False


def _uneven_last(e: Evidence) -> bool:
    if e.difference is None or e.difference.step < 2:
        return False
    update = e.difference.step  # the update that led to the first differing step
    ref, run = e.reference_examples, e.run_examples
    if len(ref) < update or len(run) < update:
        return False
    full = ref[0]
    return ref[update - 1] < full and run[update - 1] != ref[update - 1] and ref[:update - 1] == run[:update - 1]


def _loss_scale(e: Evidence) -> bool:
    n = e.replicas
    return (_diverged(e) and (e.cosine or 0) > 0.99
            and (_near(e.delta_ratio, float(n)) or _near(e.delta_ratio, 1.0 / n)))


def _clip_early(e: Evidence) -> bool:
    return _diverged(e) and e.grad_hooks > 0


def _batchnorm(e: Evidence) -> bool:
    return _diverged(e) and bool(e.unsynced_batchnorm)


CAUSES: tuple[Cause, ...] = (
    Cause("loss-not-global", "the loss is a per-replica mean, not normalised by the global batch (refused by towers)",
          "compute the loss per example and normalise it with towers.compute_average_loss(per_example)",
          _error(r"did not come from towers\.compute_average_loss|per-replica mean loss")),
    Cause("not-prepared-model", "the step calls the original model, not the one strategy.prepare returned",
          "keep `model, optimizer = strategy.prepare(model, optimizer)` and call that model",
          _error(r"model returned by strategy\.prepare was not called|not the original module")),
    Cause("unseeded-init", "the initial weights differ from one process's: the script does not seed before building "
          "the model (or seeds by rank)", "call torch.manual_seed(<same seed>) once before building the model",
          _at_start),
    Cause("replicas-drift", "the replicas' parameters drift apart: the step's gradients are not summed over the "
          "replicas (the model used in the step is not the prepared/DDP one)",
          "run the forward through the model strategy.prepare (or DDP) returned", _drift),
    Cause("whole-batch", "each replica reads the whole global batch instead of its share",
          "iterate strategy.distribute_dataset(data, global_batch_size=B) (or a DistributedSampler) so each replica "
          "gets B / N examples", _whole_batch),
    Cause("same-examples", "every replica reads the same examples: each one iterates the whole data set (no "
          "DistributedSampler), so N replicas train on one replica's share, N times",
          "give each replica its share: DataLoader(data, sampler=DistributedSampler(data), batch_size=B // N) with "
          "sampler.set_epoch(epoch) each epoch, or strategy.distribute_dataset(data, global_batch_size=B)",
          _same_examples),
    Cause("own-random-batches", "each replica draws its own random batches (by design in this script?): the replicas "
          "together train on other examples than one process, so the runs cannot match update by update",
          "if by design (nanoGPT's get_batch draws from torch.manual_seed(1337 + rank)), compare loss curves, not "
          "parameters; to verify it, draw each step's global batch from one seed on every rank and take this "
          "rank's share of it (or use strategy.distribute_dataset / a DistributedSampler with one seed)",
          _own_random_batches),
    Cause("clip-before-final", "gradients are changed (clipped) per replica before the replicas summed them "
          "(a hook on a parameter's gradient)",
          "clip once per update after backward: strategy.clip_grad_norm_(model.parameters(), max_norm)", _clip_early),
    Cause("loss-scale", "the update is N times (or 1/N of) one device's: the loss is not normalised by the global "
          "batch (divided by the per-replica batch, or averaged once more over replicas)",
          "normalise with towers.compute_average_loss(per_example) (sum / global batch)", _loss_scale),
    Cause("batchnorm-unsynced", "BatchNorm normalises each replica's share alone (not synchronised)",
          "pass sync_batchnorm=True to the strategy (or torch.nn.SyncBatchNorm.convert_sync_batchnorm)", _batchnorm),
    Cause("uneven-last-batch", "the last, shorter batch is split differently: the replicas trained on another set of "
          "examples than one device (a DistributedSampler repeats examples to even out the shares)",
          "use strategy.distribute_dataset (exact ragged batches), or drop_last=True on both", _uneven_last),
)


def name_cause(evidence: Evidence) -> Cause | None:
    """Return the first cause of the catalogue that fits ``evidence``, or None when none does.

    Args:
        evidence: what a run showed against the one-process run.

    Returns:
        The cause, in the catalogue's order (``CAUSES``).
    """
    for cause in CAUSES:
        if cause.test(evidence):
            return cause
    return None
