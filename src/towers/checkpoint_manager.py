"""``CheckpointManager``: numbered checkpoints of a custom loop in one folder, keep the last N, restore the latest.

The equivalent of ``tf.train.CheckpointManager``::

    manager = CheckpointManager("ckpt/", max_to_keep=3)
    state = manager.restore({"model": model, "optimizer": optimizer})   # None on a fresh start
    start = state["epoch"] + 1 if state else 0
    for epoch in range(start, 10):
        ...
        manager.save({"model": model, "optimizer": optimizer, "epoch": epoch})

Files are ``<prefix>-<number>.pt``, written atomically by the chief (``towers.checkpoint``); the
oldest beyond ``max_to_keep`` are deleted after each save, by the chief. Every replica calls
``save`` and ``restore``; on several machines the folder must be shared (as for any checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from towers._logging import get_logger
from towers.checkpoint import remove_stale_temp_files, restore_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from towers.strategies.base import Strategy

__all__ = ["CheckpointManager"]

log = get_logger(__name__)

_PREFIX = re.compile(r"^[A-Za-z0-9_.-]+$")


class CheckpointManager:
    """Numbered checkpoints in ``directory``: ``save`` adds one and keeps the newest ``max_to_keep``.

    ``max_to_keep=None`` keeps every checkpoint. ``strategy``: the job's strategy, so that only the
    chief writes and deletes, every replica agrees on the number, and a prepared model is saved
    and restored through the strategy (full weights, wherever they live).

    Raises:
        ValueError: on a ``max_to_keep`` that is not a positive integer or None, or a ``prefix`` with
            characters other than letters, digits, ``_``, ``.`` and ``-``.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 5, prefix: str = "ckpt",
                 strategy: "Strategy | None" = None):
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer, or None to keep every checkpoint. "
                             f"Received: {max_to_keep!r}.")
        if not isinstance(prefix, str) or not _PREFIX.match(prefix):
            raise ValueError(f"prefix must be letters, digits, '_', '.' or '-' (it starts each file name). "
                             f"Received: {prefix!r}. Example: 'ckpt'.")
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.prefix = prefix
        self.strategy = strategy
        self._pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)\.pt$")
        if self.directory.is_dir():
            remove_stale_temp_files(self.directory)  # left by a writer killed mid-save

    def _numbered(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = self._pattern.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    @property
    def checkpoints(self) -> list[Path]:
        """Return the checkpoints in ``directory``, oldest first."""
        return [path for _, path in self._numbered()]

    @property
    def latest_checkpoint(self) -> Path | None:
        """Return the newest checkpoint, or None when there is none."""
        numbered = self._numbered()
        return numbered[-1][1] if numbered else None

    def save(self, state: Mapping[str, Any], *, checkpoint_number: int | None = None) -> Path:
        """Write ``state`` (your dict, as ``towers.checkpoint.save_checkpoint`` takes it) as the next checkpoint.

        ``checkpoint_number`` names the file (e.g. the epoch or step); by default one more than the
        newest. Then the oldest files beyond ``max_to_keep`` are deleted. Returns the path.

        Raises:
            ValueError: on a negative or non-integer ``checkpoint_number``.
            CheckpointError: when ``state`` holds a value that would not load with ``weights_only=True``.
            OSError: on every replica, when the chief could not write the file.
        """
        if checkpoint_number is None:
            numbered = self._numbered()
            checkpoint_number = numbered[-1][0] + 1 if numbered else 0
            if self.strategy is not None:  # the chief's folder is the one that counts
                checkpoint_number = self.strategy.broadcast_object(checkpoint_number, src=0)
        elif isinstance(checkpoint_number, bool) or not isinstance(checkpoint_number, int) or checkpoint_number < 0:
            raise ValueError(f"checkpoint_number must be an integer >= 0. Received: {checkpoint_number!r}.")
        path = save_checkpoint(self.directory / f"{self.prefix}-{checkpoint_number}.pt", state,
                               strategy=self.strategy, kind="user")
        if self.strategy is None or self.strategy.is_chief:
            self._prune(keep=path)
        return path

    def _prune(self, keep: Path) -> None:
        if self.max_to_keep is None:
            return
        others = [p for _, p in self._numbered() if p != keep]
        for old in others[:max(0, len(others) - (self.max_to_keep - 1))]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
                log.debug("deleted old checkpoint %s (max_to_keep=%d)", old, self.max_to_keep)

    def restore(self, objects: Mapping[str, Any] | None = None, *,
                path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
        """Load the newest checkpoint (or ``path``) into ``objects``; return its whole dict, or None when there is none.

        Raises:
            CheckpointError: when the file is torn or foreign, or a state does not fit its object.
        """
        target = Path(path) if path is not None else self.latest_checkpoint
        if target is None:
            return None
        state = restore_checkpoint(target, objects, strategy=self.strategy)
        log.info("restored checkpoint %s", target)
        return state

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
                f"prefix={self.prefix!r}, checkpoints={len(self.checkpoints)})")
