"""``CSVLogger`` and ``TensorBoard``: epoch logs to files, written by the chief only."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Mapping

from towers.errors import InvalidArgumentError
from towers.training.callbacks.base import Callback

__all__ = ["CSVLogger", "TensorBoard"]


class CSVLogger(Callback):
    """Append one row per epoch (``epoch`` 0-based, then the logs' keys, sorted) to ``filename`` on the chief.

    Args:
        filename: the CSV file.
        separator: the field separator.
        append: add to an existing file (a resumed run) instead of starting it anew.
    """

    def __init__(self, filename: str | os.PathLike[str], *, separator: str = ",", append: bool = False):
        super().__init__()
        self.filename = Path(filename)
        self.separator = separator
        self.append = append
        self._file: Any = None
        self._writer: Any = None
        self._keys: list[str] | None = None

    def _is_chief(self) -> bool:
        return self.attached and self.trainer.strategy.is_chief

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if not self._is_chief():
            return
        self.filename.parent.mkdir(parents=True, exist_ok=True)
        appending = self.append and self.filename.is_file() and self.filename.stat().st_size > 0
        self._keys = None
        if appending:
            with open(self.filename, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            self._keys = header[1:] if header else None
        self._file = open(self.filename, "a" if appending else "w", newline="")
        self._writer = csv.writer(self._file, delimiter=self.separator)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is None:
            return
        logs = dict(logs or {})
        if self._keys is None:
            self._keys = sorted(logs)
            self._writer.writerow(["epoch", *self._keys])
        self._writer.writerow([epoch, *(logs.get(k, "") for k in self._keys)])
        self._file.flush()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "The TensorBoard callback needs the tensorboard package, which is not installed "
            f"({exc}). Install it with: pip install 'towers[tensorboard]'  (or: pip install tensorboard).") from exc
    return SummaryWriter


class TensorBoard(Callback):
    """Write the epoch logs (and every ``update_freq`` steps' batch logs) as TensorBoard scalars, on the chief.

    Training values go under ``train/<name>``, validation under ``validation/<name>``.
    Needs ``pip install 'towers[tensorboard]'``.

    Args:
        log_dir: the folder TensorBoard reads (``tensorboard --logdir``).
        update_freq: ``"epoch"`` writes the epoch logs only; an integer ``n`` also every ``n``-th step's batch
            logs.

    Raises:
        ImportError: at construction, on every replica, when tensorboard is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", *, update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq != "epoch" and not (isinstance(update_freq, int) and update_freq > 0):
            raise InvalidArgumentError(f"update_freq must be 'epoch' or a positive number of steps. Received: {update_freq!r}.")
        self._writer_class = _summary_writer_class()
        self.log_dir = Path(log_dir)
        self.update_freq = update_freq
        self._writer: Any = None

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if self.attached and self.trainer.strategy.is_chief:
            self._writer = self._writer_class(log_dir=str(self.log_dir))

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is None or self.update_freq == "epoch":
            return
        logs = logs or {}
        step = int(logs.get("global_step", 0))
        if step % int(self.update_freq) == 0:
            for key in ("loss", *(m.name for m in self.trainer.metrics)):
                if key in logs:
                    self._writer.add_scalar(f"batch/{key}", float(logs[key]), step)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is None:
            return
        for key, value in (logs or {}).items():
            tag = f"validation/{key[4:]}" if key.startswith("val_") else f"train/{key}"
            self._writer.add_scalar(tag, float(value), epoch)
        self._writer.flush()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
