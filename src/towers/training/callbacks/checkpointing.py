"""``ModelCheckpoint`` (files named from the epoch and logs) and ``BackupAndRestore`` (resume at the exact step)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping

from towers._logging import get_logger
from towers.checkpoint.files import is_published
from towers.checkpoint.manager import DirectoryClaim
from towers.checkpoint.preemption import PREEMPTED_EXIT_CODE, Preempted, PreemptionHandler
from towers.checkpoint.state import CheckpointError
from towers.cluster.environ import read_environ
from towers.errors import InvalidArgumentError, user_error
from towers.training.callbacks.base import Callback
from towers.training.callbacks.stopping import resolve_mode

__all__ = ["ModelCheckpoint", "BackupAndRestore"]

log = get_logger(__name__)


class ModelCheckpoint(Callback):
    """Save a checkpoint at the end of each epoch to ``filepath.format(epoch=epoch + 1, **logs)``.

    The chief writes; every replica takes the same decision because the logs are reduced.

    Args:
        filepath: the file to write, formatted with ``epoch`` (1-based) and the epoch's logs, e.g.
            ``"ckpt/model-{epoch:02d}-{val_loss:.3f}.pt"``.
        monitor: the logged value ``save_best_only`` watches.
        save_best_only: write only when ``monitor`` improves; with a fixed ``filepath`` that keeps the best model.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` for accuracies, else ``"min"``).
        save_weights_only: write the model alone (``kind="weights"``), otherwise the full training state.
    """

    def __init__(self, filepath: str | os.PathLike[str], *, monitor: str = "val_loss", save_best_only: bool = False,
                 mode: str = "auto", save_weights_only: bool = False):
        super().__init__()
        self.filepath = os.fspath(filepath)
        self.monitor = monitor
        self.mode = resolve_mode(mode, monitor)
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.best = math.inf if self.mode == "min" else -math.inf
        self.last_path: str | None = None

    def _path(self, epoch: int, logs: Mapping[str, Any]) -> str:
        try:
            return self.filepath.format(epoch=epoch + 1, **logs)
        except (KeyError, IndexError, ValueError) as exc:
            raise InvalidArgumentError(f"ModelCheckpoint filepath {self.filepath!r} names a field the logs lack ({exc}). "
                                       f"Available: epoch, {', '.join(sorted(logs))}.") from exc

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        logs = dict(logs or {})
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                if self.trainer.strategy.is_chief:
                    log.warning("ModelCheckpoint: %r is not in the epoch logs (available: %s); not saving",
                                self.monitor, sorted(logs))
                return
            better = current < self.best if self.mode == "min" else current > self.best
            if not better:
                return
            self.best = float(current)
        path = self._path(epoch, logs)
        self.trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        self.last_path = path
        if self.trainer.strategy.is_chief:
            log.info("epoch %d: saved %s", epoch + 1, path)

    def state_dict(self) -> dict[str, Any]:
        """Return the best monitored value so far (saved by ``BackupAndRestore``)."""
        return {"best": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.best = float(state["best"])


class BackupAndRestore(Callback):
    """Back up the full training state to ``backup_dir``; a restarted ``fit`` resumes from it at the exact step.

    The backup is one checkpoint, ``backup_dir/backup``, replaced atomically; any strategy and number of
    replicas resumes from it. Put it before callbacks whose state should be restored (it restores theirs too).

    Args:
        backup_dir: the folder of the backup. None: the job's checkpoint directory (``TOWERS_CHECKPOINT_DIR``,
            which the manifests of ``towers k8s`` set to their checkpoint volume), so a restarted pod resumes.
        save_freq: ``"epoch"`` backs up at the end of each epoch; an integer ``n`` every ``n`` global steps (and
            the resumed run is then the same as an uninterrupted one: same data order, same RNG streams, same
            parameters).
        delete_checkpoint: delete the backup when ``fit`` finishes normally (also after an early stop), as
            Keras does; it is kept when ``fit`` raises or the process dies.
        preemption: a SIGTERM or SIGUSR1 to any process (or to ``towers launch``) makes every process back up
            at the next step they agree on and exit with ``PREEMPTED_EXIT_CODE`` for a restart, so a preemption
            costs at most one step (``towers.checkpoint.preemption``; ``TOWERS_PREEMPTION_SIGNALS`` names other
            signals, e.g. ``TERM,USR2``).

    Raises:
        ValueError: a ``save_freq`` that is neither ``"epoch"`` nor a positive integer, or an empty ``backup_dir``.

    Example:
        ```python
        import torch
        import towers
        from towers.callbacks import BackupAndRestore

        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        model = torch.nn.Linear(4, 1)
        trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=torch.nn.MSELoss())
        # Run it again after a kill: fit resumes at the step the last backup holds.
        trainer.fit(data, epochs=3, global_batch_size=16, callbacks=[BackupAndRestore("ckpt/backup", save_freq=2)])
        ```
    """

    FILENAME = "backup"

    def __init__(self, backup_dir: str | os.PathLike[str] | None = None, *, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, preemption: bool = True):
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0):
            raise InvalidArgumentError(f"save_freq must be 'epoch' or a positive number of steps. Received: {save_freq!r}.")
        if backup_dir is not None and not os.fspath(backup_dir):
            raise user_error("BackupAndRestore's backup_dir must be a non-empty path", backup_dir,
                             "Pass a folder such as 'ckpt/backup', or None for the job's TOWERS_CHECKPOINT_DIR.")
        self.backup_dir = Path(backup_dir) if backup_dir is not None else None
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.preemption: PreemptionHandler | None = None
        self._preemption = bool(preemption)
        self._claim: DirectoryClaim | None = None
        self.restored_from: dict[str, int] | None = None

    @property
    def path(self) -> Path:
        """The backup checkpoint."""
        if self.backup_dir is None:
            raise InvalidArgumentError("BackupAndRestore has no backup_dir yet: it is taken from the job at the start of fit().")
        return self.backup_dir / self.FILENAME

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        strategy = self.trainer.strategy
        if self.backup_dir is None:
            job_dir = strategy.process_info.checkpoint_dir
            if job_dir is None:
                raise InvalidArgumentError(
                    "BackupAndRestore() was given no backup_dir and the job has no checkpoint directory "
                    "(TOWERS_CHECKPOINT_DIR is unset). Pass BackupAndRestore('path/to/backup') or set "
                    "TOWERS_CHECKPOINT_DIR.")
            self.backup_dir = Path(job_dir) / "backup"
        # The chief claims the folder (a second job writing there is refused) and decides whether there is a
        # backup, so every replica takes the same branch.
        found: tuple[bool, str | None] = (False, None)
        if strategy.is_chief:
            try:
                if self._claim is None:
                    self._claim = DirectoryClaim.acquire(self.backup_dir)
                # A backup published without its state.pt is damaged: restoring it names the damage (never a fresh start).
                found = (strategy.checkpoint_exists(self.path) or is_published(self.path), None)
            except (CheckpointError, OSError) as exc:
                found = (False, str(exc))
        exists, problem = strategy.broadcast_object(found, src=0)
        if problem is not None:
            raise CheckpointError(f"BackupAndRestore cannot use {self.backup_dir}: {problem}")
        if self._preemption:
            self.preemption = PreemptionHandler.for_job(read_environ(), rank=strategy.process_info.rank).install()
        if not exists:
            return
        state = self.trainer.load_checkpoint(str(self.path))  # under any strategy and size
        self.restored_from = {"epoch": int(state["epoch"]), "step": int(state["step"]),
                              "global_step": int(state["global_step"])}
        if strategy.is_chief:
            log.info("BackupAndRestore: resuming from %s at epoch %d, step %d (global step %d)", self.path,
                     self.restored_from["epoch"] + 1, self.restored_from["step"], self.restored_from["global_step"])

    def _backup(self) -> None:
        self.trainer.save_checkpoint(str(self.path))

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        step = self.trainer.progress.global_step
        can_save = self.trainer.strategy.at_preemption_boundary()  # under DiLoCo: only after an outer step
        if self.preemption is not None and self.preemption.should_save(step, can_save=can_save):
            self._backup()
            self.trainer.strategy.wait_for_checkpoint()  # an asynchronous save must be on disk before the exit
            if self.trainer.strategy.is_chief:
                log.warning("preempted: backed up to %s at global step %d; exiting with code %d for a restart",
                            self.path, step, PREEMPTED_EXIT_CODE)
            self.preemption.hand_on_notice()  # submitit's notice: its handler requeues the job now
            raise Preempted(step, str(self.path))
        if isinstance(self.save_freq, int) and step % self.save_freq == 0:
            self._backup()

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._backup()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        strategy = self.trainer.strategy
        if self.preemption is not None:
            self.preemption.uninstall()
            self.preemption = None
        if self._claim is not None:
            self._claim.release()
            self._claim = None
        if self.delete_checkpoint and strategy.is_chief:
            strategy.delete_checkpoint(self.path)
        strategy.barrier()  # nobody starts a new fit (and looks for a backup) before the chief deleted it
