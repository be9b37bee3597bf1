"""Sharded, atomic, reshardable checkpoints on ``torch.distributed.checkpoint`` (DCP).

Layout: the checkpoint path ``P`` is a symbolic link to a sibling directory ``.P.<id>`` that holds
DCP's files (``__<rank>_0.distcp`` written by each rank — nothing is gathered to one rank — and
``.metadata`` by the coordinator) plus ``extra.pt``, the small non-tensor state the chief writes
(epoch, step, data position, RNG states, history). Atomicity: every rank writes into a fresh
``.P.<id>`` that nothing points to yet; once DCP's save has finished on every rank, the chief
replaces the link ``P`` in one ``os.replace``. A process killed at any instant leaves ``P``
pointing at the previous complete checkpoint or the new one — never a torn one. Directories no
link points to (an interrupted save, the previous checkpoint) are removed by the next save.

Resharding: DCP stores each tensor's global shape and the offsets of every saved shard, so a
job of M processes loads a checkpoint written by N: each rank reads the pieces that overlap
its own shards.

Nothing read from a file is unpickled beyond plain data: DCP's ``.metadata`` is read by an
unpickler that admits only DCP's own metadata classes and torch's dtypes and sizes, non-tensor
values load with ``weights_only=True``, and ``extra.pt`` loads with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from towers._logging import get_logger

__all__ = ["ShardedCheckpointError", "is_sharded_checkpoint", "save_sharded", "load_sharded", "read_extra",
           "wait_pending"]

log = get_logger(__name__)

_EXTRA = "extra.pt"
_MARKER = "towers.sharded_checkpoint"


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint is absent, foreign or does not fit; the message names the path and the fix."""


def _data_dir(path: Path, uid: str) -> Path:
    return path.parent / f".{path.name}.{uid}"


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Return True when ``path`` is a complete sharded checkpoint (a link to a directory with DCP metadata)."""
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file() and (p / _EXTRA).is_file()


# --- safe reading ----------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch's plain value types, nothing else."""

    _TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)
    _ALLOWED = {("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),  # a layout from its name
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath")}  # the checkpoint id DCP records

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, self._TORCH_TYPES):
                return value
        if module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from a checkpoint's metadata (only DCP metadata and torch value "
            "types are allowed)")


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(Path(self.path) / name, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._nested_dict import set_element

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner()


@contextlib.contextmanager
def _quiet_single_process() -> Any:
    # DCP warns on every single-process save/load that it "assumes" one process; here that is the point.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- writing ---------------------------------------------------------------------------------------
class _Pending:
    """An asynchronous save in flight: published (on the chief) as soon as its write is done, from DCP's thread."""

    def __init__(self, future: Any, publish: Callable[[], None], path: Path):
        import threading

        self.future, self.path = future, path
        self.started_s = time.perf_counter()
        self._published = threading.Event()
        self._error: BaseException | None = None

        def on_done(done: Any) -> None:
            try:
                done.result()
                publish()
            except BaseException as exc:  # reported by wait(), in the training thread
                self._error = exc
            finally:
                self._published.set()

        future.add_done_callback(on_done)

    def wait(self) -> None:
        """Block until the checkpoint is written and visible at its path; re-raise what went wrong."""
        self._published.wait()
        if self._error is not None:
            raise OSError(f"Asynchronous checkpoint {self.path} failed: {type(self._error).__name__}: "
                          f"{self._error}. The previous checkpoint at that path is intact.") from self._error
        log.debug("async checkpoint %s visible %.2f s after it started", self.path,
                  time.perf_counter() - self.started_s)


def wait_pending(pending: _Pending | None, *, is_chief: bool, broadcast_object: Callable[[Any, int], Any]) -> None:
    """Block until an asynchronous save (if any) is written and published; every rank calls it.

    Raises:
        OSError: on every rank, when the save failed on the chief (the previous checkpoint is intact).
    """
    if pending is None:
        return
    if not is_chief:  # its own background write; a failure there fails the chief's too (DCP gathers them)
        with contextlib.suppress(Exception):
            pending.wait()
    _chief_error(is_chief, broadcast_object, pending.wait)


def _foreign(path: Path) -> str | None:
    if path.exists() and not path.is_symlink():
        return (f"Cannot write a sharded checkpoint at {path}: a file or directory that towers did not write is "
                "there. Pick another path or move it away.")
    return None


def _publish(path: Path, data_dir: Path) -> None:
    """Point ``path`` at ``data_dir`` in one atomic step, then remove unreferenced siblings (chief only)."""
    for f in data_dir.iterdir():
        _fsync(f)
    _fsync(data_dir)
    problem = _foreign(path)
    if problem:
        raise ShardedCheckpointError(problem)
    link = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(data_dir.name, link)
    os.replace(link, path)
    _fsync(path.parent)
    for stale in path.parent.glob(f".{path.name}.*"):
        if stale != data_dir and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _chief_error(is_chief: bool, broadcast_object: Callable[[Any, int], Any], action: Callable[[], None]) -> None:
    """Run ``action`` on the chief; every rank raises if it failed (so none waits for the chief in a collective)."""
    error = None
    if is_chief:
        try:
            action()
        except Exception as exc:  # reported to every rank below
            error = (type(exc).__name__, str(exc))
    error = broadcast_object(error, 0)
    if error is None:
        return
    kind, text = error
    if kind == ShardedCheckpointError.__name__:
        raise ShardedCheckpointError(text)
    raise OSError(f"The chief could not write the sharded checkpoint: {kind}: {text}. Check the directory and "
                  "free space; the previous checkpoint at that path is intact.")


def save_sharded(path: str | os.PathLike[str], tensors: Mapping[str, Any], extra: Mapping[str, Any], *,
                 is_chief: bool, broadcast_object: Callable[[Any, int], Any],
                 process_group: Any = None, async_save: bool = False) -> _Pending | None:
    """Write a sharded checkpoint at ``path``: each rank its shards of ``tensors``, the chief ``extra``; atomically.

    Every rank calls this. ``tensors`` is a (nested) state dict of DTensors / tensors (the model's
    and optimizer's sharded state); ``extra`` holds plain values only (it loads with
    ``weights_only=True``). With ``async_save`` the shards are copied to memory and written by a
    background thread: the call returns a pending save, published by the chief as soon as every
    rank's shards are written; ``wait_pending`` blocks until then.

    Raises:
        ShardedCheckpointError: on every rank, when something towers did not write is at ``path``.
        OSError: on every rank, when the chief cannot create or publish the checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    path = Path(path)
    uid = broadcast_object(uuid.uuid4().hex[:12] if is_chief else None, 0)
    data_dir = _data_dir(path, uid)

    def start() -> None:
        problem = _foreign(path)
        if problem:
            raise ShardedCheckpointError(problem)
        data_dir.mkdir(parents=True, exist_ok=False)
        torch.save({"format": _MARKER, **dict(extra)}, data_dir / _EXTRA)

    _chief_error(is_chief, broadcast_object, start)  # also: the directory exists before any rank writes into it
    writer = FileSystemWriter(data_dir, sync_files=True)
    state = dict(tensors)

    def publish() -> None:
        if is_chief:
            _publish(path, data_dir)

    no_dist = not torch.distributed.is_initialized()  # one process: no collectives
    if async_save:
        with _quiet_single_process():
            future = dcp.async_save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
        # DCP's coordinator writes .metadata only after every rank's shards are written, so when the
        # chief's future is done the directory is complete and is published at once.
        return _Pending(future, publish, path)
    with _quiet_single_process():
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    _chief_error(is_chief, broadcast_object, publish)  # every rank returns after the checkpoint is visible
    return None


# --- reading ---------------------------------------------------------------------------------------
def _check(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"No sharded checkpoint at {path}. Check the path (or that a save finished).")
    if not is_sharded_checkpoint(path):
        raise ShardedCheckpointError(
            f"{path} is not a towers sharded checkpoint (expected a directory with DCP's .metadata and {_EXTRA}). "
            "A single-file checkpoint is loaded by the strategy that wrote it (e.g. MirroredStrategy).")


def read_extra(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the non-tensor state the chief wrote with the checkpoint (loaded with ``weights_only=True``).

    Raises:
        FileNotFoundError: when there is nothing at ``path``.
        ShardedCheckpointError: when ``path`` is not a complete towers sharded checkpoint.
    """
    path = Path(path)
    _check(path)
    extra = torch.load(path / _EXTRA, map_location="cpu", weights_only=True)
    if not isinstance(extra, dict) or extra.pop("format", None) != _MARKER:
        raise ShardedCheckpointError(f"{path / _EXTRA} was not written by towers; the checkpoint is foreign.")
    return extra


def load_sharded(path: str | os.PathLike[str], tensors: dict[str, Any], *, process_group: Any = None) -> None:
    """Load the checkpoint at ``path`` into ``tensors`` in place (resharding to this job's layout); every rank calls it.

    Raises:
        FileNotFoundError: when there is nothing at ``path``.
        ShardedCheckpointError: when it is not a towers sharded checkpoint, or its tensors do not fit.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    _check(path)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=_reader(path.resolve()), planner=_planner(), process_group=process_group,
                     no_dist=not torch.distributed.is_initialized())
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:  # CheckpointException is a BaseException
        cause = _root_cause(exc)
        raise ShardedCheckpointError(
            f"Sharded checkpoint {path} cannot be loaded into this model/optimizer: {cause}. Build the same model "
            "and optimizer that wrote it; a torn or foreign checkpoint cannot be loaded.") from None


def _root_cause(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures = [f for f in exc.failures.values()]
        if failures:
            return "; ".join(f"{type(f).__name__}: {str(f).splitlines()[-1] if str(f) else ''}" for f in failures[:2])
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
