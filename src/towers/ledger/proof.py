"""Read a run's ledger and prove that each example of each completed epoch was trained exactly once.

A restore line (``R ... restore``) rolls back every update line at or after its position that was
written before it by its own process or by a process that wrote nothing after it (one of the job's
earlier processes, gone when the job restored): those updates were trained, then lost with the state
the job restored over. A process of the restored job that is still writing (a parameter server, a
worker that started sooner) keeps its lines. What is left is the run's history; its positions are
counted per epoch and mapped to dataset indices through the epoch's order (``OrderSpec``). A share seen
committed by another replica (``W``) counts once, and only where no replica's own line (``U``) of the same
step records it: the share of a replica group lost between its update's commit and its own line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from towers.errors import InvalidArgumentError, user_error
from towers.ledger.record import LEDGER_SUBDIR, OrderSpec

__all__ = ["Update", "EpochProof", "LedgerProof", "prove_ledger", "read_ledger"]

#: Examples listed by name in a report line (the rest are counted).
_SHOW = 8


@dataclass(frozen=True)
class Update:
    """One committed share: positions ``[lo, hi)`` of ``epoch``'s order, from global batch ``batch`` at ``step``."""

    time: float
    step: int
    epoch: int
    batch: int
    lo: int
    hi: int
    order: OrderSpec
    writer: str
    #: A ``W`` line: another replica's share of the update, seen committed by ``writer``.
    witnessed: bool = False


@dataclass(frozen=True)
class _GoOn:
    time: float
    epoch: int
    position: int
    how: str
    writer: str


@dataclass
class EpochProof:
    """One epoch's count: examples trained once, never (``missing``) and more than once (``doubled``).

    Attributes:
        epoch: the epoch (0-based).
        num_examples: the examples of the epoch's order.
        complete: whether the epoch finished (a later epoch has updates, or its last global batch was trained).
        once: the examples trained exactly once.
        missing: one line per run of positions never trained (the first few).
        doubled: one line per example trained more than once (the first few).
        missing_count: the examples never trained.
        doubled_count: the examples trained more than once.
        counts: how many times each example was trained, indexed by dataset index (a stream's: by position).
    """

    epoch: int
    num_examples: int
    complete: bool
    once: int = 0
    missing: list[str] = field(default_factory=list)  # one line per run of missing positions
    doubled: list[str] = field(default_factory=list)  # one line per doubled example (the first few)
    missing_count: int = 0
    doubled_count: int = 0
    #: How many times each example was trained, indexed by dataset index (a stream's: by position in the stream).
    counts: torch.Tensor | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """True when no example was doubled and, for a complete epoch, none was missed."""
        return self.doubled_count == 0 and (self.missing_count == 0 or not self.complete)

    @property
    def verdict(self) -> str:
        """``exactly once``, ``in progress (k of n)``, or what went wrong."""
        if self.doubled_count:
            return f"{self.doubled_count} example(s) trained more than once"
        if not self.complete:
            return f"in progress ({self.once} of {self.num_examples})"
        return "exactly once" if not self.missing_count else f"{self.missing_count} example(s) never trained"


@dataclass
class LedgerProof:
    """What ``prove_ledger`` found: each epoch's proof, and what it read and dropped.

    Attributes:
        run_dir: the run's folder.
        files: the ledger files read.
        updates: the updates counted (each share of an update once).
        rolled_back: the updates dropped because a start or restore went back to before them.
        restores: one line per start or restore the job went on from.
        epochs: each epoch's proof, in order.
        witnessed: shares counted from a ``W`` line alone: their replica was lost before it recorded them.
    """

    run_dir: str
    files: int
    updates: int
    rolled_back: int
    restores: list[str]
    epochs: list[EpochProof]
    #: Shares counted from a ``W`` line alone: their replica was lost before it recorded them.
    witnessed: int = 0

    @property
    def ok(self) -> bool:
        """True when every epoch is exact (completed ones: each example once; the one in progress: none twice)."""
        return all(e.ok for e in self.epochs)

    def format(self) -> str:
        """The report ``towers verify --ledger`` prints."""
        lines = [f"ledger of {self.run_dir}: {self.files} file(s), {self.updates} committed update line(s) kept, "
                 f"{self.rolled_back} rolled back by {len(self.restores)} start(s) or restore(s)"]
        lines += [f"  {r}" for r in self.restores]
        if self.witnessed:
            lines.append(f"  {self.witnessed} share(s) counted from another replica's record of the committed "
                         "update (their own replica was lost before it recorded them)")
        header = ("epoch", "examples", "trained once", "missing", "doubled", "verdict")
        rows = [tuple(str(v) for v in (e.epoch, e.num_examples, e.once, e.missing_count if e.complete else "-",
                                       e.doubled_count, e.verdict)) for e in self.epochs]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        for e in self.epochs:
            for line in e.missing + e.doubled:
                lines.append(f"epoch {e.epoch}: {line}")
        lines.append("verdict: every example of every completed epoch trained exactly once" if self.ok else
                     "verdict: NOT exact (see the lines above)")
        return "\n".join(lines)


def _files(run_dir: str | os.PathLike[str]) -> list[Path]:
    root = Path(run_dir)
    if not root.is_dir():
        raise user_error("towers verify --ledger needs the run's directory", repr(str(run_dir)),
                         "Pass the directory the job wrote its ledger under (TOWERS_LEDGER_DIR, or "
                         "towers launch --ledger DIR).", cls=FileNotFoundError)
    folder = root / LEDGER_SUBDIR if (root / LEDGER_SUBDIR).is_dir() else root
    found = sorted(folder.glob("*.tsv"))
    if not found:
        raise user_error("No ledger files were found", f"{folder} holds no *.tsv",
                         "Run the job with TOWERS_LEDGER_DIR=DIR (or towers launch --ledger DIR) and pass that DIR.",
                         cls=FileNotFoundError)
    return found


def read_ledger(run_dir: str | os.PathLike[str]) -> tuple[list[Update], list[_GoOn], dict[str, float]]:
    """Return every update line and every go-on line of the run's ledger files, and each file's last line's time.

    A line cut short (a process killed while writing it) is skipped.

    Raises:
        FileNotFoundError: no ledger under ``run_dir``.
        ValueError: a line that is not the ledger's format (another file, or a damaged one).
    """
    updates: list[Update] = []
    go_ons: list[_GoOn] = []
    last: dict[str, float] = {}
    files = _files(run_dir)
    for path in files:
        order: OrderSpec | None = None
        text = path.read_text()
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        elif lines:
            lines.pop()  # the last line was cut short: its process died while writing it
        for number, line in enumerate(lines, start=1):
            parts = line.split("\t")
            try:
                if parts[0] == "H":
                    h = json.loads(parts[1])
                    last[path.stem] = max(last.get(path.stem, 0.0), float(h["time"]))
                    order = OrderSpec(int(h["num_examples"]), int(h["global_batch_size"]), int(h["seed"]),
                                      bool(h["shuffle"]))
                elif parts[0] in ("U", "W"):
                    if order is None:
                        raise InvalidArgumentError("an update line before any header")
                    t, step, epoch, batch, lo, hi = parts[1:7]
                    updates.append(Update(float(t), int(step), int(epoch), int(batch), int(lo), int(hi), order,
                                          path.stem, witnessed=parts[0] == "W"))
                    last[path.stem] = max(last[path.stem], float(t))
                elif parts[0] == "R":
                    t, epoch, position, how = parts[1:5]
                    go_ons.append(_GoOn(float(t), int(epoch), int(position), how, path.stem))
                    last[path.stem] = max(last.get(path.stem, 0.0), float(t))
                else:
                    raise InvalidArgumentError(f"unknown line kind {parts[0]!r}")
            except (ValueError, KeyError, IndexError, json.JSONDecodeError) as exc:
                raise user_error(f"{path} line {number} is not a ledger line ({exc})", line[:120],
                                 "Pass a directory holding only the ledger files towers wrote.") from None
    return updates, go_ons, last


def _order(spec: OrderSpec, epoch: int) -> torch.Tensor:
    if not spec.shuffle:
        return torch.arange(spec.num_examples)
    return torch.randperm(spec.num_examples, generator=torch.Generator().manual_seed(spec.seed + epoch))


def _runs(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of consecutive positions."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _prove_epoch(epoch: int, kept: list[Update], complete: bool) -> EpochProof:
    specs = {u.order for u in kept}
    if len({(s.num_examples, s.seed, s.shuffle) for s in specs}) > 1:
        raise user_error(f"The ledger's epoch {epoch} mixes inputs of different orders", sorted(specs, key=str),
                         "Give towers verify --ledger one run's directory (one dataset, seed and shuffle).")
    spec = kept[0].order
    n = spec.num_examples
    count = torch.zeros(n, dtype=torch.int64)
    for u in kept:
        count[u.lo:u.hi] += 1
    order = _order(spec, epoch)
    by_index = torch.zeros(n, dtype=torch.int64)
    by_index[order] = count
    proof = EpochProof(epoch, n, complete, once=int((count == 1).sum()), counts=by_index)
    doubled = torch.nonzero(count > 1).flatten().tolist()
    proof.doubled_count = len(doubled)
    for p in doubled[:_SHOW]:
        by = sorted((u.time, u.step, u.writer) for u in kept if u.lo <= p < u.hi)
        steps = ", ".join(f"step {s} ({w})" for _, s, w in by)
        proof.doubled.append(f"example {int(order[p])} (position {p}, global batch {p // spec.global_batch_size}) "
                             f"trained {len(by)} times: {steps}")
    if complete:
        missing = torch.nonzero(count == 0).flatten().tolist()
        proof.missing_count = len(missing)
        by_time = sorted(kept, key=lambda u: u.time)
        for a, b in _runs(missing)[:_SHOW]:
            before = [u for u in by_time if u.hi <= a]
            after = [u for u in by_time if u.lo >= b]
            around = (f"after step {before[-1].step} ({before[-1].writer})" if before else "at the epoch's start") + \
                (f", before step {after[0].step} ({after[0].writer})" if after else "")
            shown = ", ".join(str(int(i)) for i in order[a:min(b, a + _SHOW)])
            more = f", ... ({b - a} in all)" if b - a > _SHOW else ""
            proof.missing.append(f"positions {a}..{b - 1} (global batch {a // spec.global_batch_size}; dataset "
                                 f"indices {shown}{more}) never trained: {around}")
    return proof


def prove_ledger(run_dir: str | os.PathLike[str]) -> LedgerProof:
    """Prove from ``run_dir``'s ledger that each example of each completed epoch was trained exactly once.

    An epoch is complete when a later epoch has updates, or its last global batch was trained.

    Args:
        run_dir: the run's folder, which holds ``ledger/`` (``towers launch --ledger DIR``).

    Returns:
        The proof; ``towers verify --ledger`` prints it.

    Raises:
        FileNotFoundError: no ledger under ``run_dir``.
        ValueError: a damaged ledger, or one that mixes inputs.
    """
    updates, go_ons, last = read_ledger(run_dir)
    restores = [g for g in go_ons if g.how == "restore"]

    def rolls_back(r: _GoOn, u: Update) -> bool:
        return (u.time < r.time and (u.epoch, u.lo) >= (r.epoch, r.position)
                and (u.writer == r.writer or last[u.writer] < r.time))

    described: dict[tuple[int, int], list[_GoOn]] = {}  # the restores to one position (each process's line)
    for r in restores:
        described.setdefault((r.epoch, r.position), []).append(r)
    lost = dict.fromkeys(described, 0)  # per restored position: the update lines it rolled back
    kept: list[Update] = []
    for u in updates:
        by = [key for key, rs in described.items() if any(rolls_back(r, u) for r in rs)]
        for key in by:
            lost[key] += 1
        if not by:
            kept.append(u)
    rolled_back = len(updates) - len(kept)
    kept, witnessed = _one_record_per_share(kept)
    restore_lines = []
    for (epoch, position), rs in sorted(described.items(), key=lambda kv: min(r.time for r in kv[1])):
        where = "started at the beginning" if (epoch, position) == (0, 0) else \
            f"restored to epoch {epoch}, example {position} of its order"
        restore_lines.append(f"{where} ({len(rs)} process(es)); {lost[(epoch, position)]} update line(s) written "
                             "before it rolled back")
    by_epoch: dict[int, list[Update]] = {}
    for u in kept:
        by_epoch.setdefault(u.epoch, []).append(u)
    epochs = []
    final_epoch = max(by_epoch, default=-1)
    for epoch in range(min(by_epoch, default=0), final_epoch + 1):
        if epoch not in by_epoch:  # an epoch between two trained ones without a single update
            spec = by_epoch[final_epoch][0].order
            epochs.append(EpochProof(epoch, spec.num_examples, True, missing_count=spec.num_examples,
                                     missing=[f"all {spec.num_examples} examples never trained: no update of this "
                                              "epoch is in the ledger"]))
            continue
        spec = by_epoch[epoch][0].order
        complete = epoch < final_epoch or any(u.hi >= spec.num_examples for u in by_epoch[epoch])
        epochs.append(_prove_epoch(epoch, by_epoch[epoch], complete))
    return LedgerProof(str(run_dir), len(last), len(kept) - witnessed, rolled_back, restore_lines, epochs,
                       witnessed=witnessed)


def _one_record_per_share(kept: list[Update]) -> tuple[list[Update], int]:
    """``kept`` without each ``W`` share that a ``U`` line of its step, or an earlier ``W`` line, records; and how
    many ``W`` lines are left in (shares whose own replica never recorded them)."""
    def key(u: Update) -> tuple[int, int, int, int]:
        return u.epoch, u.step, u.lo, u.hi

    recorded = {key(u) for u in kept if not u.witnessed}
    out, count = [], 0
    for u in kept:
        if u.witnessed:
            if key(u) in recorded:
                continue
            recorded.add(key(u))
            count += 1
        out.append(u)
    return out, count
