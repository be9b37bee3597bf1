"""``CheckpointManager``: numbered checkpoints of a custom loop in one folder, keep the last N, restore the latest.

The equivalent of ``tf.train.CheckpointManager`` plus TF's ``PreemptionCheckpointHandler``::

    manager = CheckpointManager("ckpt/", strategy=strategy, max_to_keep=3)
    state = manager.restore({"model": model, "optimizer": optimizer, "data": batches})  # None on a fresh start
    step = state["step"] if state else 0
    for x, y in batches:
        strategy.run(train_step, args=(x, y)); step += 1
        manager.save_if_preempted({"model": model, "optimizer": optimizer, "data": batches, "step": step}, step=step)
        if step % 100 == 0:
            manager.save({"model": model, "optimizer": optimizer, "data": batches, "step": step})

Checkpoints are directories ``<prefix>-<number>`` (``towers.checkpoint``: each process writes its
part, published atomically); the oldest beyond ``max_to_keep`` are deleted after each save, by the
chief. Every process calls ``save``, ``restore`` and ``save_if_preempted``; on several machines the
folder must be shared. Each checkpoint also holds every process's RNG streams (key ``"rng"``),
which ``restore`` puts back, so a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path
from typing import Any, Mapping

from towers._logging import get_logger
from towers._rng import replica_rng_state
from towers.checkpoint import api, layout
from towers.checkpoint.files import is_published
from towers.checkpoint.preemption import Preempted, PreemptionHandler
from towers.checkpoint.state import CheckpointError, CorruptCheckpointError, rng_state, set_rng_state
from towers.cluster.environ import read_environ
from towers.errors import InvalidArgumentError, NotFoundError

__all__ = ["CheckpointManager", "DirectoryClaim"]

log = get_logger(__name__)

_PREFIX = re.compile(r"^[A-Za-z0-9_.-]+$")
_LOCK = ".towers-writer.lock"


class DirectoryClaim:
    """An exclusive claim, held by the chief, on a checkpoint directory: a second job writing there is refused.

    ``DirectoryClaim.acquire(directory)`` returns this process's claim (one per directory and
    process: a notebook that runs ``fit`` again after an error keeps its claim) or takes it.
    """

    _held: dict[str, "DirectoryClaim"] = {}  # this process's claims: flock is a per-process resource

    def __init__(self, directory: Path):
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        self.key = str(directory.resolve())
        self.path = directory / _LOCK
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise CheckpointError(
                f"Another job is writing checkpoints to {directory} ({holder}); two jobs writing one directory would "
                "delete each other's checkpoints. Give each job its own directory, or stop the other job.") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str]) -> "DirectoryClaim":
        """Return this process's claim on ``directory``, taking it if needed.

        Raises:
            CheckpointError: another process holds it (naming that process).
            OSError: the directory cannot be created.
        """
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        held = cls._held.get(str(path.resolve()))
        if held is None:
            held = cls._held[str(path.resolve())] = cls(path)
        return held

    def release(self) -> None:
        """Give the claim up (also when the process exits)."""
        if self._fd >= 0:
            self._held.pop(self.key, None)
            with contextlib.suppress(OSError):
                self.path.unlink()  # before the lock goes: nobody else holds this file
            os.close(self._fd)
            self._fd = -1


class CheckpointManager:
    """Numbered checkpoints in ``directory``: ``save`` adds one and keeps the newest ``max_to_keep``.

    Args:
        directory: the folder of the numbered checkpoints (``<prefix>-<number>``).
        max_to_keep: the newest checkpoints kept; None keeps every one.
        prefix: the checkpoints' name before the number.
        strategy: the job's strategy, so that each process writes its part, the chief deletes, every process
            agrees on the number, and the prepared model is saved and restored wherever it lives.
        preemption: a SIGTERM/SIGUSR1 notice makes ``save_if_preempted`` save at a step every process agrees
            on and exit for a restart (``towers.checkpoint.preemption``; ``TOWERS_PREEMPTION_SIGNALS=TERM,USR2``
            names other signals).

    Raises:
        ValueError: on a ``max_to_keep`` that is not a positive integer or None, or a ``prefix`` with
            characters other than letters, digits, ``_``, ``.`` and ``-``.

    Example:
        ```python
        import torch
        from towers.checkpoint import CheckpointManager

        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        manager = CheckpointManager("ckpt/example", max_to_keep=2)
        state = manager.restore({"model": model, "optimizer": optimizer})  # None on a fresh start
        start = state["epoch"] + 1 if state else 0
        for epoch in range(start, 3):
            manager.save({"model": model, "optimizer": optimizer, "epoch": epoch})
        assert [path.name for path in manager.checkpoints] == ["ckpt-1", "ckpt-2"]
        manager.close()
        ```
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 5, prefix: str = "ckpt",
                 strategy: "api.CheckpointStrategy | None" = None, preemption: bool = True):
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int)
                                        or max_to_keep < 1):
            raise InvalidArgumentError(f"max_to_keep must be a positive integer, or None to keep every checkpoint. "
                                       f"Received: {max_to_keep!r}.")
        if not isinstance(prefix, str) or not _PREFIX.match(prefix):
            raise InvalidArgumentError(f"prefix must be letters, digits, '_', '.' or '-' (it starts each checkpoint's name). "
                                       f"Received: {prefix!r}. Example: 'ckpt'.")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"CheckpointManager's directory {self.directory} is a file. Pass a folder path.")
        self.max_to_keep = max_to_keep
        self.prefix = prefix
        self.strategy = strategy
        self._pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)$")
        self._claim: DirectoryClaim | None = None
        self.preemption = PreemptionHandler.for_job(read_environ(), rank=_rank(strategy)).install() if preemption else None

    def _numbered(self, *, damaged: bool = False) -> list[tuple[int, Path]]:
        """The complete checkpoints, oldest first; with ``damaged``, also those published without their ``state.pt``."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = self._pattern.match(entry.name)
            if match and (layout.is_checkpoint(entry) or (damaged and is_published(entry))):
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

    def _is_chief(self) -> bool:
        return self.strategy is None or self.strategy.is_chief

    def save(self, state: Mapping[str, Any], *, checkpoint_number: int | None = None) -> Path:
        """Write ``state`` (your dict, as ``towers.checkpoint.save_checkpoint`` takes it) as the next checkpoint.

        Args:
            state: your dict, as ``towers.checkpoint.save_checkpoint`` takes it.
            checkpoint_number: names it (e.g. the step). Default: one more than the newest.

        Returns:
            The checkpoint's path. The oldest beyond ``max_to_keep`` are deleted.

        Raises:
            ValueError: on a negative or non-integer ``checkpoint_number``.
            CheckpointError: when ``state`` holds a value that would not load with ``weights_only=True``,
                or another job writes checkpoints to the same directory.
            OSError: on every process, when the checkpoint cannot be written (the previous one stays loadable).
        """
        if checkpoint_number is not None and (isinstance(checkpoint_number, bool) or not isinstance(checkpoint_number, int)
                                              or checkpoint_number < 0):
            raise InvalidArgumentError(f"checkpoint_number must be an integer >= 0. Received: {checkpoint_number!r}.")
        number, claim_error = checkpoint_number, None
        if self._is_chief():
            try:
                if self._claim is None:
                    self._claim = DirectoryClaim.acquire(self.directory)
            except (CheckpointError, OSError) as exc:
                claim_error = str(exc)
            if number is None:
                numbered = self._numbered()
                number = numbered[-1][0] + 1 if numbered else 0
        if self.strategy is not None:  # the chief's folder is the one that counts
            number, claim_error = self.strategy.broadcast_object((number, claim_error), src=0)
        if claim_error is not None:
            raise CheckpointError(claim_error)
        full = dict(state)
        if "rng" not in full:
            full["rng"] = self.strategy.all_gather_object(rng_state()) if self.strategy is not None else [rng_state()]
        path = api.save_checkpoint(self.directory / f"{self.prefix}-{number}", full, strategy=self.strategy)
        if self._is_chief():
            self._prune(keep=path)
        return path

    def save_if_preempted(self, state: Mapping[str, Any], *, step: int) -> None:
        """Call at every step boundary (``step`` steps done, the same on every process); on a preemption notice, save and exit.

        Returns at once without a notice (one look at the job's store). After a notice, every
        process saves ``state`` at the same step as checkpoint ``step`` (under DiLoCo: the first step that
        ends a window from the agreed one on) and raises ``Preempted``
        (a ``SystemExit`` with ``PREEMPTED_EXIT_CODE``), which asks the launcher for a restart.

        Args:
            state: what to save on a notice, as ``save`` takes it.
            step: the steps done, the same on every process.

        Raises:
            Preempted: after the checkpoint is written (a ``SystemExit`` with ``PREEMPTED_EXIT_CODE``).
        """
        can_save = self.strategy is None or self.strategy.at_preemption_boundary()  # DiLoCo: only after an outer step
        if self.preemption is None or not self.preemption.should_save(step, can_save=can_save):
            return
        path = self.save(state, checkpoint_number=step)
        if self.strategy is not None:
            self.strategy.checkpoint_io().wait(is_chief=self.strategy.is_chief,
                                               broadcast_object=self.strategy.broadcast_object)  # on disk before exit
        log.warning("preempted: saved %s at step %d; exiting for a restart", path, step)
        self.preemption.hand_on_notice()  # submitit's notice: its handler requeues the job now
        raise Preempted(step, str(path))

    def _prune(self, keep: Path) -> None:
        if self.max_to_keep is None:
            return
        others = [p for _, p in self._numbered() if p != keep]
        for old in others[:max(0, len(others) - (self.max_to_keep - 1))]:
            with contextlib.suppress(FileNotFoundError):
                layout.delete(old)
                log.debug("deleted old checkpoint %s (max_to_keep=%d)", old, self.max_to_keep)

    def restore(self, objects: Mapping[str, Any] | None = None, *, path: str | os.PathLike[str] | None = None,
                restore_rng: bool = True) -> dict[str, Any] | None:
        """Load the newest intact checkpoint (or ``path``) into ``objects``; return its whole dict, or None when there is none.

        A damaged checkpoint (a file missing, unreadable or changed since it was written) is passed
        over for the next older one, with a WARNING naming it; every process takes the same
        decision.

        Args:
            objects: keys of the saved dict -> live objects to load into, as ``restore_checkpoint`` takes them.
            path: a checkpoint to restore instead of the newest.
            restore_rng: put this process's saved RNG streams back (a job of another size takes those of saved
                replica ``replica_id % saved``).

        Returns:
            Everything the checkpoint holds, or None when ``directory`` has none.

        Raises:
            CorruptCheckpointError: when ``path`` is damaged, or every checkpoint in ``directory`` is.
            CheckpointError: when it is foreign, or a state does not fit its object.
        """
        # A published checkpoint that lost its state.pt is a candidate too: passed over with a WARNING, as all damage.
        candidates = [str(path)] if path is not None else [str(p) for _, p in reversed(self._numbered(damaged=True))]
        if self.strategy is not None and path is None:  # every process tries the chief's list, newest first
            candidates = self.strategy.broadcast_object(candidates, src=0)
        if not candidates:
            return None
        target, state = self._first_intact([Path(c) for c in candidates], objects, fall_back=path is None)
        rngs = state.get("rng")
        if restore_rng and isinstance(rngs, list) and rngs and "rng" not in (objects or {}):
            set_rng_state(replica_rng_state(rngs, _replica_id(self.strategy)))
        log.info("restored checkpoint %s", target)
        return state

    def _first_intact(self, candidates: list[Path], objects: Mapping[str, Any] | None, *,
                      fall_back: bool) -> tuple[Path, dict[str, Any]]:
        """Restore the first of ``candidates`` that is intact; return it and its state."""
        for i, target in enumerate(candidates):
            try:  # a damaged file raises on every process alike (integrity.py), before anything is loaded
                return target, api.restore_checkpoint(target, objects, strategy=self.strategy)
            except (CorruptCheckpointError, NotFoundError) as exc:  # NotFound: its link points to a folder that is gone
                if not fall_back:
                    raise
                if i + 1 == len(candidates):
                    raise CorruptCheckpointError(
                        f"No intact checkpoint in {self.directory}: all {len(candidates)} are damaged; the oldest: "
                        f"{exc}") from None
                if self._is_chief():
                    log.warning("%s Falling back to the previous checkpoint, %s.", exc, candidates[i + 1])
        raise CorruptCheckpointError(f"No checkpoint to restore in {self.directory}.")  # not reached: one candidate or more

    def close(self) -> None:
        """Give up the preemption signals and the claim on the directory."""
        if self.preemption is not None:
            self.preemption.uninstall()
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def __repr__(self) -> str:
        return (f"CheckpointManager({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
                f"prefix={self.prefix!r}, checkpoints={len(self.checkpoints)})")


def _replica_id(strategy: Any) -> int:
    return int(getattr(strategy, "replica_id", 0)) if strategy is not None else 0


def _rank(strategy: Any) -> int:
    info = getattr(strategy, "process_info", None)
    return int(getattr(info, "rank", 0)) if info is not None else 0
