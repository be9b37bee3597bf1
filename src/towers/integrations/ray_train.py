"""Ray Train: a towers training function inside ``TorchTrainer``, its checkpoints and metrics through Ray.

Ray Train's torch backend makes the process group and sets torchrun's variables in every worker, so
``towers.strategy_from_env()`` (or a strategy built by name) runs on Ray's group as it runs under
``towers launch`` (``towers.cluster.ray``). This module adds what Ray needs from a towers job:

- ``train_loop(fn)``: wraps the ``train_loop_per_worker``: logs each worker's place, ends a ps task's function
  cleanly once it served, runs at the function's end what towers runs at a process's exit elsewhere (a Ray
  worker's process lives on), and lets the ps tasks, which are Ray workers too, take their part in
  ``ray.train.report`` (every Ray worker must call it as often as the others; a ps task serving in its
  constructor cannot, so a thread of its own mirrors the chief's calls, announced in the job's store).
- ``report(metrics, checkpoint=dir)``: every replica calls it; the chief's metrics, and a towers checkpoint
  directory as a ``ray.train.Checkpoint``, reach Ray.
- ``latest_checkpoint()``: the directory of Ray's latest reported checkpoint (after a restart), or None.
- ``RayReport``: the Trainer callback that reports each epoch's logs (and a checkpoint) through ``report``.

Ray is imported when these run, never by ``import towers``; without it each names the extra to install.
"""

from __future__ import annotations

import functools
import numbers
import os
import shutil
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from towers._logging import get_logger
from towers.checkpoint.files import data_dir_for
from towers.cluster import describe, from_env
from towers.cluster.info import ProcessInfo
from towers.cluster.ray import INSTALL_HINT, RAY_SOURCE, current_ray_loop, ray_loop_scope
from towers.errors import FailedPreconditionError, InvalidArgumentError, InvalidTypeError, NotFoundError
from towers.launch.spawn import cpu_threads_per_process
from towers.training.callbacks.base import Callback
from towers.training.callbacks.checkpointing import BackupAndRestore

__all__ = ["train_loop", "report", "latest_checkpoint", "import_ray_train", "ray_metrics", "RayReport"]

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: How often a ps task's report thread looks for the chief's next report (seconds).
_POLL_S = 0.05
#: The store's prefix for the chief's report announcements.
_PREFIX = "towers/ray/report"


def import_ray_train() -> ModuleType:
    """Return the ``ray.train`` module.

    Returns:
        ``ray.train``.

    Raises:
        ImportError: Ray Train is not installed; the message names the extra to install.
    """
    try:
        import ray.train
    except ImportError as exc:
        raise ImportError(f"towers' Ray Train integration needs ray[train], which could not be imported. Received: "
                          f"{type(exc).__name__}: {exc}. Install the optional extra: {INSTALL_HINT}.") from exc
    return ray.train


def _store(info: ProcessInfo) -> dist.Store:
    # Ray's rank 0 hosts the store of Ray's process group at MASTER_ADDR:MASTER_PORT; a client of our own.
    store = dist.TCPStore(info.master_addr, int(info.master_port or 0), is_master=False,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    return dist.PrefixStore(_PREFIX, store)


class _Loop:
    """One run of a wrapped function on one Ray worker (``towers.cluster.ray.RayLoop``)."""

    def __init__(self, info: ProcessInfo):
        self.info = info
        self.is_ps = False
        self.reports = 0  # reports this process made (the chief: announced in the store)
        self._at_end: list[Callable[[], None]] = []
        self._relay: threading.Thread | None = None
        self._relay_error: BaseException | None = None
        self._store: dist.Store | None = None

    def store(self) -> dist.Store:
        if self._store is None:
            self._store = _store(self.info)
        return self._store

    def at_end(self, callback: Callable[[], None]) -> None:
        self._at_end.append(callback)

    def ps_task_started(self, info: ProcessInfo) -> None:
        self.is_ps = True
        self._relay = threading.Thread(target=self._mirror_reports, name="towers-ray-reports", daemon=True)
        self._relay.start()

    def announce_report(self) -> None:
        """On the chief, before its ``ray.train.report``: the ps tasks make their matching call."""
        self.reports += 1
        self.store().set(str(self.reports), "")

    def _mirror_reports(self) -> None:
        train = import_ray_train()
        store, done = self.store(), 0
        try:
            while True:
                if store.check([str(done + 1)]):
                    train.report({}, checkpoint=None)
                    done += 1
                elif store.check(["end"]) and done >= int(store.get("end")):
                    return
                else:
                    time.sleep(_POLL_S)
        except BaseException as exc:  # noqa: BLE001 - the main thread raises it when the ps task ends
            self._relay_error = exc

    def end_worker(self) -> None:
        """The function returned on a worker: run what towers would run at exit; the chief closes the reports."""
        if self.info.is_chief and self.info.world_size > 1:
            self.store().set("end", str(self.reports))
        for callback in reversed(self._at_end):
            callback()

    def end_ps(self, timeout_s: float = 120.0) -> None:
        """The ps task served to the end: wait for its report thread to make the chief's last report."""
        if self._relay is not None:
            self._relay.join(timeout_s)
            if self._relay.is_alive():
                raise FailedPreconditionError(
                    f"[rank {self.info.rank}/{self.info.world_size}] ps task: the chief announced no end of its "
                    f"ray.train.report calls within {timeout_s:g} s after the workers finished. Every worker must "
                    "run inside towers.ray.train_loop and report through towers.ray.report.")
        if self._relay_error is not None:
            raise self._relay_error


def train_loop(fn: F) -> F:
    """Return ``fn`` wrapped for ``TorchTrainer(train_loop_per_worker=...)``: towers' part of each Ray worker.

    The wrapper logs the worker's place in the job, runs ``fn`` (with Ray's ``config`` when it takes one), and
    then what towers runs at a process's exit under other launchers (a Ray worker's process lives on). On a
    parameter-server ps task (the last ``num_ps`` Ray workers) it takes the task's part in ``ray.train.report``
    while the task serves, and ends the function normally once the workers are done. Needed under parameter
    servers; harmless under every other strategy.

    Args:
        fn: the training function, ``fn(config)`` or ``fn()``.

    Returns:
        A function with ``fn``'s signature, to pass to ``TorchTrainer``.

    Raises:
        ImportError: Ray Train is not installed (the message names the extra).
        FailedPreconditionError: (when the wrapped function runs) outside a Ray Train worker.
    """
    import_ray_train()
    if not callable(fn):
        raise InvalidArgumentError(f"train_loop takes the training function. Received: {fn!r}. "
                                   "Example: TorchTrainer(towers.ray.train_loop(train_func), ...).")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        info = from_env()
        if info.source != RAY_SOURCE:
            raise FailedPreconditionError(
                f"towers.ray.train_loop runs inside a Ray Train worker. Received: a process described by "
                f"{info.source!r} variables. Pass the wrapped function to ray.train.torch.TorchTrainer, or call "
                "the function itself under another launcher.")
        log.info("Ray Train worker: %s, %d torch thread(s)", describe(info), torch.get_num_threads())
        _note_threads(info)
        loop = _Loop(info)
        try:
            with ray_loop_scope(loop):
                result = fn(*args, **kwargs)
        except SystemExit as exc:
            if loop.is_ps and exc.code in (0, None):  # the ps task served until the workers were done
                loop.end_ps()
                return None
            raise
        loop.end_worker()
        return result

    return wrapped  # type: ignore[return-value]


def _note_threads(info: ProcessInfo) -> None:
    # A process's bits depend on torch's intra-op thread count: towers launch gives cores // processes per host, Ray
    # the worker's CPUs. Said once, by the chief, when they differ (the same count gives the same bits).
    threads, launch_threads = torch.get_num_threads(), cpu_threads_per_process(info.local_world_size)
    if info.is_chief and threads != launch_threads and info.local_world_size > 0:
        log.warning("Ray gives this worker %d torch thread(s); towers launch would give %d on this host (cores // "
                    "%d processes), so results differ from its in the last bits, and steps take another time. For "
                    "the same: ScalingConfig(resources_per_worker={'CPU': %d}), or the same OMP_NUM_THREADS for both.",
                    threads, launch_threads, info.local_world_size, launch_threads)


def ray_metrics(logs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return ``logs`` as Ray takes metrics: numbers as floats or ints, 0-d tensors as numbers, strings kept.

    Args:
        logs: a dict of metrics (epoch logs, a loss tensor, ...).

    Returns:
        The entries Ray can carry; others (lists, tensors of several values) are left out.
    """
    out: dict[str, Any] = {}
    for key, value in (logs or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or isinstance(value, str):
            out[str(key)] = value
        elif isinstance(value, numbers.Integral):
            out[str(key)] = int(value)
        elif isinstance(value, numbers.Real):
            out[str(key)] = float(value)
    return out


def report(metrics: Mapping[str, Any], *, checkpoint: str | os.PathLike[str] | None = None) -> None:
    """Report ``metrics`` (and a towers checkpoint directory) to Ray Train. Every replica calls it, in step.

    Ray keeps the chief's metrics and registers ``checkpoint`` (the directory ``CheckpointManager.save`` or
    ``save_checkpoint`` returned) as a ``ray.train.Checkpoint`` copied to the run's storage; the chief uploads it,
    so the directory must hold every process's part (one host, or a shared file system). Under parameter servers
    the ps tasks' matching calls are made for them (``train_loop``).

    Args:
        metrics: numbers (tensors of one value are read out); see ``ray_metrics``.
        checkpoint: the checkpoint directory to report, or None.

    Raises:
        ImportError: Ray Train is not installed.
        FailedPreconditionError: outside a function wrapped by ``train_loop``.
        NotFoundError: (FileNotFoundError) ``checkpoint`` is not a directory.
    """
    train = import_ray_train()
    loop = current_ray_loop()
    if not isinstance(loop, _Loop):
        raise FailedPreconditionError("towers.ray.report runs inside a function wrapped by towers.ray.train_loop. "
                                      "Received: a call outside one. Fix: TorchTrainer(towers.ray.train_loop(fn), ...).")
    ray_checkpoint = None
    if checkpoint is not None and loop.info.is_chief:
        path = Path(checkpoint)
        if not path.is_dir():
            raise NotFoundError(f"towers.ray.report: checkpoint must be a checkpoint directory. Received: {path}, which "
                                "is not one. Pass the path CheckpointManager.save or save_checkpoint returned.")
        ray_checkpoint = train.Checkpoint.from_directory(os.fspath(path.resolve()))
    if loop.info.is_chief and loop.info.world_size > 1:
        loop.announce_report()
    train.report(ray_metrics(metrics), checkpoint=ray_checkpoint)


def latest_checkpoint() -> Path | None:
    """Return the directory of the latest checkpoint reported to Ray Train (on a restart), or None.

    Pass it to ``towers.checkpoint.restore_checkpoint(path, objects, strategy=...)`` or
    ``CheckpointManager.restore(objects, path=...)``. A checkpoint in remote storage is downloaded first.

    Returns:
        A local directory, or None when Ray has no checkpoint for this run.

    Raises:
        ImportError: Ray Train is not installed.
    """
    train = import_ray_train()
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return None
    if getattr(checkpoint.filesystem, "type_name", "local") == "local" and os.path.isdir(checkpoint.path):
        return Path(checkpoint.path)
    return Path(checkpoint.to_directory())


class RayReport(Callback):
    """Report each epoch's logs to Ray Train (``ray.train.report``), with ``backup``'s checkpoint when given.

    The logs are the chief's (loss, metrics, validation, ``examples_per_second``, ``mfu``: every replica holds the
    same) plus ``epoch`` (counted from 1). Every replica calls ``report`` at each epoch's end, as Ray requires.
    Put it after the ``BackupAndRestore`` it reports, so that the backup of the epoch is written first. When the
    backup's folder holds no backup at the start of ``fit`` (a restarted group on another node, a fresh folder)
    and Ray has a checkpoint, the chief copies Ray's latest checkpoint there first, so ``BackupAndRestore``
    resumes from it.

    Args:
        backup: a ``BackupAndRestore`` of the same ``fit`` (``save_freq="epoch"`` or a step count): its backup is
            reported as the epoch's ``ray.train.Checkpoint``. None: metrics only.

    Raises:
        InvalidTypeError: (TypeError) ``backup`` is not a ``BackupAndRestore``.
    """

    def __init__(self, backup: BackupAndRestore | None = None):
        super().__init__()
        if backup is not None and not isinstance(backup, BackupAndRestore):
            raise InvalidTypeError(f"RayReport's backup must be the fit's towers.callbacks.BackupAndRestore. Received: "
                                   f"{type(backup).__name__}. Pass the same object you put in callbacks=[...].")
        self.backup = backup

    def set_params(self, params: Mapping[str, Any]) -> None:
        """Take ``fit``'s parameters; bring Ray's latest checkpoint into an empty backup folder (every replica)."""
        super().set_params(params)
        if self.backup is None or self.backup.backup_dir is None:
            return
        strategy = self.trainer.strategy
        if strategy.is_chief and not self.backup.path.exists():
            latest = latest_checkpoint()
            if latest is not None:
                # towers' own layout: the files in a directory beside the path, published by one link's replace.
                data_dir = data_dir_for(self.backup.path, f"ray{uuid.uuid4().hex[:9]}")
                shutil.copytree(latest, data_dir)
                link = self.backup.path.with_name(f".{self.backup.path.name}.link-{uuid.uuid4().hex[:8]}")
                os.symlink(data_dir.name, link)
                os.replace(link, self.backup.path)
                log.info("RayReport: Ray's latest checkpoint %s copied to %s for BackupAndRestore", latest,
                         self.backup.path)
        strategy.barrier()  # the copy is whole before any replica looks for the backup

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Report the epoch's logs (and the backup) to Ray Train."""
        path = self.backup.path if self.backup is not None and self.backup.backup_dir is not None else None
        report({"epoch": epoch + 1, **ray_metrics(logs)}, checkpoint=path if path is not None and path.is_dir() else None)
