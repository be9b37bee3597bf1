"""The ledger's file format and its writer: one append-only text file per writing process.

Lines, tab-separated, each written with one ``write`` to a file opened for appending (a process killed
at any moment leaves whole lines, or one cut last line that the reader skips):

``H  <json>``                       an input's order: ``{"num_examples", "global_batch_size", "seed", "shuffle",
                                   "writer", "rank", "world_size", "time"}`` (before its first update line)
``U  <time> <global step> <epoch> <global batch> <lo> <hi>``
                                   a committed share: positions ``[lo, hi)`` of the epoch's example order
``W  <time> <global step> <epoch> <global batch> <lo> <hi>``
                                   another replica's share of the same committed update, seen committed here:
                                   under fault tolerance a group can be lost after its share entered the
                                   update and before it wrote its ``U`` line, so each live group also records
                                   the others' shares of the step; the proof counts a ``W`` share once, and
                                   only where no ``U`` line of the same step records it
``R  <time> <epoch> <step> <how>``  the job went on from its ``step``-th global batch of ``epoch``: ``how`` is
                                   ``restore`` (from a checkpoint: every update line at or after that
                                   position written before this line was rolled back) or ``join`` (a
                                   replica group joined a running job: nothing rolled back)

Positions, not dataset indices, are recorded: an epoch's order is a permutation fixed by the header
(``seed + epoch``), so the reader maps them to dataset indices, and a line stays a few numbers.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from towers._logging import get_logger
from towers.errors import InvalidArgumentError, user_error

__all__ = ["LEDGER_SUBDIR", "OrderSpec", "LedgerWriter"]

log = get_logger(__name__)

#: The folder under a run's directory that holds the ledger files.
LEDGER_SUBDIR = "ledger"


@dataclass(frozen=True)
class OrderSpec:
    """What fixes an epoch's example order: ``randperm(num_examples, seed + epoch)`` when ``shuffle``, else ``arange``.

    Attributes:
        num_examples: the examples of the dataset.
        global_batch_size: the examples of one update over all replicas.
        seed: the order's seed (epoch ``e`` uses ``seed + e``).
        shuffle: whether the order is shuffled.
    """

    num_examples: int
    global_batch_size: int
    seed: int
    shuffle: bool


class LedgerWriter:
    """Append ledger lines for one process to ``<run_dir>/ledger/<name>-<pid>.tsv`` (created on first use).

    Each process writes a file of its own (the pid keeps a restarted rank from writing into its
    predecessor's), so no two processes append to one file.

    Args:
        run_dir: the run's folder.
        name: the file's name before the pid, e.g. ``rank0``.
        rank: this process's rank, written in its lines.
        world_size: the job's processes, written in its lines.
    """

    def __init__(self, run_dir: str | os.PathLike[str], name: str, *, rank: int = 0, world_size: int = 1):
        self.dir = Path(run_dir) / LEDGER_SUBDIR
        self.path = self.dir / f"{name}-{os.getpid()}.tsv"
        self.name, self.rank, self.world_size = name, rank, world_size
        self._fd: int | None = None
        self._order: OrderSpec | None = None
        self.records = 0  # update lines written

    def _write(self, line: str) -> None:
        if self._fd is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as exc:  # a file where the folder should be, no permission, a read-only disk
                raise user_error(f"Cannot write the ledger under {self.dir}", f"{type(exc).__name__}: {exc.strerror}",
                                 "Pass towers launch --ledger (TOWERS_LEDGER_DIR, or ExampleLedger's run_dir) a "
                                 "directory this process can create and write.", cls=type(exc)) from exc
        os.write(self._fd, line.encode())

    def order(self, spec: OrderSpec) -> None:
        """Note the order of the input the next update lines come from (written only when it changes)."""
        if spec == self._order:
            return
        self._order = spec
        header: dict[str, Any] = {**asdict(spec), "writer": self.name, "rank": self.rank,
                                  "world_size": self.world_size, "time": time.time()}
        self._write("H\t" + json.dumps(header, sort_keys=True) + "\n")

    def update(self, global_step: int, epoch: int, batch: int, lo: int, hi: int) -> None:
        """Record that positions ``[lo, hi)`` of ``epoch``'s order, in global batch ``batch``, were trained and committed."""
        self._write(f"U\t{time.time():.6f}\t{global_step}\t{epoch}\t{batch}\t{lo}\t{hi}\n")
        self.records += 1

    def witnessed(self, global_step: int, epoch: int, batch: int, lo: int, hi: int) -> None:
        """Record that positions ``[lo, hi)``, another replica's share of the update of ``global_step``, were in the
        update this process committed (a ``W`` line: proof for a share whose replica was lost before recording it)."""
        self._write(f"W\t{time.time():.6f}\t{global_step}\t{epoch}\t{batch}\t{lo}\t{hi}\n")

    def went_on(self, epoch: int, step: int, how: str) -> None:
        """Record that the job went on from global batch ``step`` of ``epoch`` (``how``: ``restore`` or ``join``)."""
        if how not in ("restore", "join"):
            raise InvalidArgumentError(f"how must be 'restore' or 'join'. Received: {how!r}.")
        self._write(f"R\t{time.time():.6f}\t{epoch}\t{step}\t{how}\n")

    def close(self) -> None:
        """Close the file (a later line opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
