"""Reading the captures of ``towers verify`` runs and comparing them: parameters, update sizes, replicas, examples.

A capture is one directory per rank (``rank<r>/``) of ``step<i>.pt`` records, the parameters after ``i``
updates plus what the script did in update ``i + 1`` (``towers.verify_capture``).
"""

from __future__ import annotations

import collections
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from towers.verify_capture import load_step

__all__ = ["Capture", "Difference", "Evidence", "load_capture", "first_difference", "worst_difference", "delta_ratio",
           "gather_evidence"]

#: Differences below this fraction of a tensor's scale (its largest magnitude, at least the model's median one)
#: are float32 rounding: the replicas sum gradients in another order, and Adam amplifies it in near-zero gradients.
DEFAULT_TOLERANCE = 1e-3


@dataclass
class Capture:
    """One rank's records: ``steps[i]`` the parameters after ``i`` updates; ``observed[u - 1]`` what update ``u`` consumed."""

    names: list[str]
    steps: list[list[torch.Tensor]]
    observed: list[dict[str, Any]] = field(default_factory=list)
    unsynced_batchnorm: list[str] = field(default_factory=list)

    @property
    def updates(self) -> int:
        """How many updates the records cover (the parameters after each of them are known)."""
        return max(0, len(self.steps) - 1)


@dataclass(frozen=True)
class Difference:
    """The first recorded step at which two runs differ: the tensor that differs most, relative to its scale."""

    step: int
    tensor: str
    relative: float


@dataclass(frozen=True)
class Evidence:
    """What a run showed against the one-process run: the facts the cause catalogue reads.

    Attributes:
        replicas: the run's replica count.
        error: the run's error (None: it ran).
        updates: the updates it recorded.
        difference: the first recorded step at which it differs from the one-process run (None: none).
        delta_ratio: |run's update| / |one process's update| at the first differing update.
        cosine: the cosine of the two updates there.
        replica_drift_step: the first step at which some replica's parameters differ from replica 0's.
        reference_examples: the examples per update of the one-process run.
        run_examples: the examples per update, summed over the replicas.
        replica_examples: the examples per update of replica 0 alone.
        unsynced_batchnorm: BatchNorm modules whose statistics are not synchronised across replicas.
        grad_hooks: the gradient hooks the script registered.
        same_examples_on_replicas: every replica trained on the same examples in the first differing update.
        first_update_as_one_process: the replicas' examples of the first update, together, are one process's
            (None: not fingerprinted).
    """

    replicas: int
    error: str | None = None
    updates: int = 0
    difference: Difference | None = None
    #: |run's update| / |one process's update| and their cosine at the first differing update (None before it).
    delta_ratio: float | None = None
    cosine: float | None = None
    #: The first step at which some replica's parameters differ from replica 0's (None: never).
    replica_drift_step: int | None = None
    reference_examples: tuple[int, ...] = ()  # per update, one process
    run_examples: tuple[int, ...] = ()  # per update, summed over the replicas
    replica_examples: tuple[int, ...] = ()  # per update, replica 0 alone
    unsynced_batchnorm: tuple[str, ...] = ()
    grad_hooks: int = 0
    #: Every replica trained on the same examples in the first differing update (their fingerprints agree).
    same_examples_on_replicas: bool = False
    #: The replicas' examples of the first update, together, are one process's (None: not fingerprinted).
    first_update_as_one_process: bool | None = None


def load_capture(directory: str) -> Capture | None:
    """Return the records under ``directory`` (one rank's), or None when the run recorded nothing."""
    try:
        files = os.listdir(directory)
    except FileNotFoundError:
        return None
    indices = sorted(int(m.group(1)) for f in files if (m := re.fullmatch(r"step(\d+)\.pt", f)))
    indices = [i for n, i in enumerate(indices) if i == n]  # a contiguous run from step 0
    if not indices:
        return None
    with open(os.path.join(directory, "meta.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    records = [load_step(os.path.join(directory, f"step{i}.pt")) for i in indices]
    observed = [r["next_update"] for r in records if not r["final"]]
    return Capture(names=list(meta["names"]), steps=[list(r["tensors"]) for r in records], observed=observed,
                   unsynced_batchnorm=list(meta.get("unsynced_batchnorm", [])))


def _model_scale(tensors: Sequence[torch.Tensor]) -> float:
    """The median over tensors of their largest magnitude: the floor of every tensor's scale.

    A bias that starts at zero has a tiny scale of its own; measured against it, the float32 rounding
    Adam amplifies in a near-zero gradient would look like a difference.
    """
    maxima = sorted(float(t.abs().max()) for t in tensors if t.numel())
    return maxima[len(maxima) // 2] if maxima else 0.0


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    scale = max(float(b.abs().max()), float(a.abs().max()), floor, 1e-6)
    return float((a - b).abs().max()) / scale


def first_difference(reference: Sequence[Sequence[torch.Tensor]], run: Sequence[Sequence[torch.Tensor]],
                     names: Sequence[str], *, tolerance: float = DEFAULT_TOLERANCE) -> Difference | None:
    """Return the first step at which ``run`` differs from ``reference`` (beyond ``tolerance``), or None."""
    for step, (ours, theirs) in enumerate(zip(reference, run)):
        if len(ours) != len(theirs):
            return Difference(step, f"{len(theirs)} parameters instead of {len(ours)}", float("inf"))
        floor = _model_scale(ours)
        worst = max(((_relative(b, a, floor), i) for i, (a, b) in enumerate(zip(ours, theirs))), default=(0.0, 0))
        if worst[0] > tolerance:
            name = names[worst[1]] if worst[1] < len(names) else f"param{worst[1]}"
            return Difference(step, name, worst[0])
    return None


def worst_difference(reference: Sequence[Sequence[torch.Tensor]], run: Sequence[Sequence[torch.Tensor]],
                     names: Sequence[str]) -> Difference | None:
    """Return the largest relative difference over every recorded step (None when nothing was recorded)."""
    worst = None
    for step, (ours, theirs) in enumerate(zip(reference, run)):
        floor = _model_scale(ours)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            value = _relative(b, a, floor)
            if worst is None or value > worst.relative:
                worst = Difference(step, names[i] if i < len(names) else f"param{i}", value)
    return worst


def delta_ratio(reference: Sequence[Sequence[torch.Tensor]], run: Sequence[Sequence[torch.Tensor]],
                step: int) -> tuple[float, float] | None:
    """Return (|run's update| / |reference's update|, cosine of the two) for the update that led to ``step``."""
    if step < 1 or step >= min(len(reference), len(run)):
        return None
    ours = torch.cat([(a - b).flatten().double() for a, b in zip(reference[step], reference[step - 1])])
    theirs = torch.cat([(a - b).flatten().double() for a, b in zip(run[step], run[step - 1])])
    if ours.shape != theirs.shape or float(ours.norm()) == 0.0:
        return None
    cosine = float(torch.dot(ours, theirs) / (ours.norm() * theirs.norm()).clamp_min(1e-300))
    return float(theirs.norm() / ours.norm()), cosine


def _examples(capture: Capture) -> tuple[int, ...]:
    return tuple(int(o.get("examples", 0)) for o in capture.observed)


def _rows(capture: Capture | None, update: int) -> collections.Counter[str] | None:
    """The fingerprints of the examples ``update`` (1-based) trained on, as a multiset (None: not recorded)."""
    if capture is None or not 0 < update <= len(capture.observed):
        return None
    rows = capture.observed[update - 1].get("rows")
    return collections.Counter(rows) if rows else None


def _same_examples(ranks: Sequence[Capture | None], update: int) -> bool:
    """True when every replica's examples of ``update`` are the same ones (two replicas or more)."""
    seen = [_rows(r, update) for r in ranks]
    return len(seen) > 1 and all(s is not None and s == seen[0] for s in seen)


def _as_one_process(reference: Capture, ranks: Sequence[Capture | None], update: int) -> bool | None:
    """Whether the replicas' examples of ``update``, together, are the one process's (None: not recorded)."""
    ours, theirs = _rows(reference, update), [_rows(r, update) for r in ranks]
    if ours is None or any(t is None for t in theirs):
        return None
    return sum((t for t in theirs if t is not None), collections.Counter()) == ours


def gather_evidence(reference: Capture, ranks: Sequence[Capture | None], *, replicas: int, error: str | None,
                    tolerance: float = DEFAULT_TOLERANCE) -> Evidence:
    """Compare one run's per-rank captures (``ranks[r]``, None where a rank recorded nothing) with the reference."""
    chief = ranks[0] if ranks else None
    if chief is None:
        return Evidence(replicas=replicas, error=error, reference_examples=_examples(reference))
    steps = min(len(reference.steps), len(chief.steps))
    difference = first_difference(reference.steps[:steps], chief.steps[:steps], reference.names, tolerance=tolerance)
    ratio = delta_ratio(reference.steps, chief.steps, difference.step) if difference is not None else None
    drift = None
    for other in ranks[1:]:
        if other is None:
            continue
        d = first_difference(chief.steps, other.steps, chief.names, tolerance=tolerance)
        if d is not None and (drift is None or d.step < drift):
            drift = d.step
    present = [r for r in ranks if r is not None]
    counted = min(len(r.observed) for r in present)
    run_examples = tuple(sum(int(r.observed[u].get("examples", 0)) for r in present) for u in range(counted))
    return Evidence(
        replicas=replicas, error=error, updates=steps - 1, difference=difference,
        delta_ratio=ratio[0] if ratio else None, cosine=ratio[1] if ratio else None, replica_drift_step=drift,
        reference_examples=_examples(reference), run_examples=run_examples, replica_examples=_examples(chief),
        unsynced_batchnorm=tuple(chief.unsynced_batchnorm),
        grad_hooks=max(int(o.get("grad_hooks", 0)) for r in present for o in (r.observed or [{}])),
        same_examples_on_replicas=difference is not None and _same_examples(ranks, difference.step),
        first_update_as_one_process=_as_one_process(reference, ranks, 1))
