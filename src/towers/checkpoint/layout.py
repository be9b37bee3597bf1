"""A checkpoint on disk: one directory, published atomically, read the same way under every strategy.

Layout: the checkpoint path ``P`` is a symbolic link to a sibling directory ``.P.<id>`` that holds
``torch.distributed.checkpoint`` (DCP) files for the model and optimizer tensors
(``__<rank>_0.distcp`` written by each rank that holds a part — replicated tensors once, by one
rank each, shards by their owners; nothing is gathered on one rank — and ``.metadata``, every
tensor's global shape and where its pieces lie) plus ``state.pt``, which the chief writes: the
manifest (format, version, strategy, replica count) and every other value of the state (epoch,
step, data position, RNG streams, your own values); and ``checksums.json``, every other file's size
and SHA-256, computed while the file was written and checked wherever it is read (``integrity.py``):
a changed, truncated or missing file is one ``CorruptCheckpointError`` naming it.

Atomicity: every rank writes into a fresh ``.P.<id>`` that nothing points to yet; once every rank
has written, the chief replaces the link ``P`` in one ``os.replace``. A process killed at any
instant leaves ``P`` pointing at the previous complete checkpoint or the new one, never a torn
one. Directories no link points to (an interrupted save, the previous checkpoint) are removed by
the next save.

Resharding: DCP records each tensor's global shape and the offsets of every saved piece, so a
job of M processes under any strategy reads a checkpoint written by N under another: a rank
reads the pieces that overlap its own shards (sharded) or the whole tensor (replicated).

Nothing read from a file is unpickled beyond plain data: DCP's ``.metadata`` is read by an
unpickler that admits only DCP's own metadata classes and torch's dtypes and sizes, and
``state.pt`` loads with ``weights_only=True``.

This module writes and publishes a checkpoint; the rest of the format lives beside it and is
re-exported here: ``files.py`` (where the files lie), ``manifest.py`` (reading ``state.pt``),
``dcp_read.py`` (reading the tensors), ``checkpoint_io.py`` (``CheckpointIO``: who writes them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from towers.checkpoint import integrity
from towers.checkpoint.checkpoint_io import CheckpointIO, Pending, chief_error
from towers.checkpoint.dcp_read import read_tensors, tensor_metadata
from towers.checkpoint.dcp_support import quiet_single_process, root_cause
from towers.checkpoint.files import FORMAT, FORMAT_VERSION, STATE_FILE, data_dir_for, delete, is_checkpoint
from towers.checkpoint.manifest import read_manifest
from towers.checkpoint.state import CheckpointError

__all__ = ["CheckpointIO", "FORMAT", "FORMAT_VERSION", "is_checkpoint", "write", "read_manifest", "tensor_metadata",
           "read_tensors", "delete"]


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _foreign(path: Path) -> str | None:
    if path.is_symlink() or not path.exists():
        return None
    what = "a file" if path.is_file() else "a directory"
    return (f"Cannot write a checkpoint at {path}: {what} that towers did not write is there (a towers checkpoint is "
            "a link to a directory it wrote). Pick another path, or move that one away.")


def _publish(path: Path, data_dir: Path) -> None:
    """Point ``path`` at ``data_dir`` in one atomic step, then remove unreferenced siblings (chief only)."""
    for f in data_dir.iterdir():
        _fsync(f)
    _fsync(data_dir)
    problem = _foreign(path)
    if problem:
        raise CheckpointError(problem)
    link = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:8]}"
    os.symlink(data_dir.name, link)
    os.replace(link, path)
    _fsync(path.parent)
    for stale in path.parent.glob(f".{path.name}.*"):
        if stale != data_dir and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)


def _save_file(value: Mapping[str, Any], path: Path) -> tuple[int, str]:
    """Write ``value`` with ``torch.save`` (synced); return its size and digest, hashed as it was written."""
    with open(path, "wb") as f:
        hashing = integrity.HashingFile(f)
        torch.save(dict(value), hashing)  # type: ignore[arg-type]  # a writable binary file, as torch needs
        f.flush()
        os.fsync(f.fileno())
    return hashing.digest()


def _nbytes(value: Any) -> int:
    """About how many bytes the tensors in ``value`` take on disk (what a full disk is told it needs)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def write(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any], *,
          io: CheckpointIO, is_chief: bool, broadcast_object: Callable[[Any, int], Any]) -> None:
    """Write a checkpoint at ``path``: ``tensors`` (flat names -> tensors or DTensors) through DCP, ``state`` by the chief.

    Every process calls this with the same names in ``tensors``. ``state`` holds plain values only
    (it loads with ``weights_only=True``); the manifest is added to it. With ``io.async_save`` the
    call returns once the tensors are copied to memory (see ``CheckpointIO``).

    Each file is hashed as it is written; ``checksums.json`` (``integrity.py``) holds the digests.

    Raises:
        CheckpointError: on every process, when something towers did not write is at ``path``.
        OSError: on every process, when the checkpoint cannot be written (the previous one is intact); on a
            full disk, "No space left on device: <path> needs about N MB" (errno ``ENOSPC``).
    """
    import torch.distributed.checkpoint as dcp

    io.wait(is_chief=is_chief, broadcast_object=broadcast_object)
    # The chief's path is the checkpoint's (a script may format it with its rank: the others write there too).
    chosen, uid = broadcast_object((str(path), uuid.uuid4().hex[:12]) if is_chief else None, 0)
    path = Path(chosen)
    data_dir = data_dir_for(path, uid)
    nbytes = _nbytes(dict(tensors)) + _nbytes(dict(state))

    def failed(exc: BaseException) -> OSError:
        if integrity.is_disk_full(exc):
            return integrity.disk_full_error(path, nbytes)
        return OSError(f"Could not write checkpoint {path}: {root_cause(exc)}. Check the directory (writable, "
                       "free space); the previous checkpoint at that path is intact.")

    def unless_full(exc: BaseException) -> BaseException:  # on the chief: chief_error reports the others
        return integrity.disk_full_error(path, nbytes) if integrity.is_disk_full(exc) else exc

    def start() -> dict[str, tuple[int, str]]:
        problem = _foreign(path)
        if problem:
            raise CheckpointError(problem)
        data_dir.mkdir(parents=True, exist_ok=False)
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "checksums": integrity.ALGORITHM, **dict(state)}
        try:
            return {STATE_FILE: _save_file(manifest, data_dir / STATE_FILE)}
        except (OSError, RuntimeError) as exc:
            raise unless_full(exc) from None

    # also: the directory exists before any process writes into it; every process learns state.pt's digest
    known = chief_error(is_chief, broadcast_object, start)

    def publish() -> None:
        if is_chief:
            _publish(path, data_dir)

    def save(no_dist: bool) -> None:
        with quiet_single_process():
            dcp.save(dict(tensors), storage_writer=integrity.digest_writer(data_dir, known),
                     process_group=io.process_group, no_dist=no_dist)

    if not tensors:
        def table_and_publish() -> None:
            try:
                integrity.write_table(data_dir, known)
            except OSError as exc:
                raise unless_full(exc) from None
            publish()

        chief_error(is_chief, broadcast_object, table_and_publish)
    elif not io.collective:  # the chief holds every tensor
        def save_and_publish() -> None:
            try:
                save(True)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise failed(exc) from None
            publish()

        chief_error(is_chief, broadcast_object, save_and_publish)
    elif io.async_save:
        no_dist = not torch.distributed.is_initialized()
        with quiet_single_process():
            future = dcp.async_save(dict(tensors), storage_writer=integrity.digest_writer(data_dir, known),
                                    process_group=io.process_group, no_dist=no_dist)
        # DCP's coordinator writes .metadata (and checksums.json) only after every process's pieces are written,
        # so when the chief's future is done the directory is complete and is published at once.
        io.pending = Pending(future, publish, path, nbytes)
    else:
        try:
            save(not torch.distributed.is_initialized())
        except BaseException as exc:  # DCP raises the same CheckpointException (a BaseException) on every process
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise failed(exc) from None
        chief_error(is_chief, broadcast_object, publish)  # every process returns after the checkpoint is visible
