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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
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
from towers.checkpoint import integrity
from towers.checkpoint.state import CheckpointError, CorruptCheckpointError

__all__ = ["CheckpointIO", "FORMAT", "FORMAT_VERSION", "is_checkpoint", "write", "read_manifest", "tensor_metadata",
           "read_tensors", "delete"]

log = get_logger(__name__)

_STATE = "state.pt"
FORMAT = "towers.checkpoint"
FORMAT_VERSION = 2


def _data_dir(path: Path, uid: str) -> Path:
    return path.parent / f".{path.name}.{uid}"


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Return True when a complete checkpoint is published at ``path`` (a directory with its ``state.pt``)."""
    p = Path(path)
    return p.is_dir() and (p / _STATE).is_file()


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


def _load_metadata(checkpoint: Path, name: str, table: integrity.Table | None, directory: Path | None = None) -> Any:
    """DCP's metadata file ``name``, checked against ``table`` and unpickled safely; one named error otherwise."""
    data = integrity.read_verified(checkpoint, name, table, directory)
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise integrity.damaged(checkpoint, name, f"cannot be parsed ({_one_line(exc)})") from None


def _reader(checkpoint: Path, table: integrity.Table | None) -> Any:
    """DCP's reader for ``checkpoint``: safe unpickling, and every file it reads checked against ``table`` first."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            metadata = _load_metadata(checkpoint, name, table, Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            # Raised here, a failure reaches every process: DCP gathers the read step's errors.
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name in per_file:
                integrity.verify_file(checkpoint, Path(self.path), name, table)
            for name, items in per_file.items():
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except CorruptCheckpointError:
                    raise
                except Exception as exc:  # an unverified (older) checkpoint: still one line naming the file
                    raise integrity.damaged(checkpoint, name, f"cannot be read ({_one_line(exc)})") from None
            done: Any = torch.futures.Future()
            done.set_result(None)
            return done

    return SafeReader(checkpoint.resolve())


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

    def __init__(self, future: Any, publish: Callable[[], None], path: Path, nbytes: int):
        import threading

        self.future, self.path, self.nbytes = future, path, nbytes
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
        if self._error is not None and integrity.is_disk_full(self._error):
            raise integrity.disk_full_error(self.path, self.nbytes) from None
        if self._error is not None:
            raise OSError(f"Asynchronous checkpoint {self.path} failed: {type(self._error).__name__}: "
                          f"{self._error}. The previous checkpoint at that path is intact.") from self._error
        log.debug("async checkpoint %s visible %.2f s after it started", self.path,
                  time.perf_counter() - self.started_s)


@dataclasses.dataclass
class CheckpointIO:
    """How a strategy's processes write a checkpoint's tensors; the strategy owns one (``Strategy.checkpoint_io``).

    ``collective``: every process writes its part through DCP over ``process_group`` (None: the
    default group), each replicated tensor once; otherwise the chief writes every tensor alone
    (parameter servers, where the state lives on ps tasks that do not run the script).
    ``async_save``: the tensors are copied to memory and written by a background thread; the save
    returns at once, and ``wait`` (called by the next save and read) blocks until it is published.
    """

    collective: bool = True
    process_group: Any = None
    async_save: bool = False
    pending: _Pending | None = None

    def wait(self, *, is_chief: bool, broadcast_object: Callable[[Any, int], Any]) -> None:
        """Block until an asynchronous save (if any) is written and published; every process calls it.

        Raises:
            OSError: on every process, when the save failed on the chief (the previous checkpoint is intact).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if not is_chief:  # its own background write; a failure there fails the chief's too (DCP gathers them)
            with contextlib.suppress(Exception):
                pending.wait()
        _chief_error(is_chief, broadcast_object, pending.wait)


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


def _chief_error(is_chief: bool, broadcast_object: Callable[[Any, int], Any], action: Callable[[], Any]) -> Any:
    """Run ``action`` on the chief and return its value on every process; every process raises if it failed.

    (So that none waits for the chief in a collective.)
    """
    error, value = None, None
    if is_chief:
        try:
            value = action()
        except Exception as exc:  # reported to every process below
            error = (type(exc).__name__, str(exc), getattr(exc, "errno", None))
    error, value = broadcast_object((error, value), 0)
    if error is None:
        return value
    kind, text, code = error
    if kind == CheckpointError.__name__:
        raise CheckpointError(text)
    if code == errno.ENOSPC and text.startswith("No space left on device:"):
        no_space = OSError(text)
        no_space.errno = errno.ENOSPC
        raise no_space
    raise OSError(f"The chief could not write the checkpoint: {kind}: {text}. Check the directory (it must be "
                  "writable, with free space); the previous checkpoint at that path is intact.")


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
    data_dir = _data_dir(path, uid)
    nbytes = _nbytes(dict(tensors)) + _nbytes(dict(state))

    def failed(exc: BaseException) -> OSError:
        if integrity.is_disk_full(exc):
            return integrity.disk_full_error(path, nbytes)
        return OSError(f"Could not write checkpoint {path}: {_root_cause(exc)}. Check the directory (writable, "
                       "free space); the previous checkpoint at that path is intact.")

    def unless_full(exc: BaseException) -> BaseException:  # on the chief: _chief_error reports the others
        return integrity.disk_full_error(path, nbytes) if integrity.is_disk_full(exc) else exc

    def start() -> dict[str, tuple[int, str]]:
        problem = _foreign(path)
        if problem:
            raise CheckpointError(problem)
        data_dir.mkdir(parents=True, exist_ok=False)
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "checksums": integrity.ALGORITHM, **dict(state)}
        try:
            return {_STATE: _save_file(manifest, data_dir / _STATE)}
        except (OSError, RuntimeError) as exc:
            raise unless_full(exc) from None

    # also: the directory exists before any process writes into it; every process learns state.pt's digest
    known = _chief_error(is_chief, broadcast_object, start)

    def publish() -> None:
        if is_chief:
            _publish(path, data_dir)

    def save(no_dist: bool) -> None:
        with _quiet_single_process():
            dcp.save(dict(tensors), storage_writer=integrity.digest_writer(data_dir, known),
                     process_group=io.process_group, no_dist=no_dist)

    if not tensors:
        def table_and_publish() -> None:
            try:
                integrity.write_table(data_dir, known)
            except OSError as exc:
                raise unless_full(exc) from None
            publish()

        _chief_error(is_chief, broadcast_object, table_and_publish)
    elif not io.collective:  # the chief holds every tensor
        def save_and_publish() -> None:
            try:
                save(True)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise failed(exc) from None
            publish()

        _chief_error(is_chief, broadcast_object, save_and_publish)
    elif io.async_save:
        no_dist = not torch.distributed.is_initialized()
        with _quiet_single_process():
            future = dcp.async_save(dict(tensors), storage_writer=integrity.digest_writer(data_dir, known),
                                    process_group=io.process_group, no_dist=no_dist)
        # DCP's coordinator writes .metadata (and checksums.json) only after every process's pieces are written,
        # so when the chief's future is done the directory is complete and is published at once.
        io.pending = _Pending(future, publish, path, nbytes)
    else:
        try:
            save(not torch.distributed.is_initialized())
        except BaseException as exc:  # DCP raises the same CheckpointException (a BaseException) on every process
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise failed(exc) from None
        _chief_error(is_chief, broadcast_object, publish)  # every process returns after the checkpoint is visible


# --- reading ---------------------------------------------------------------------------------------
def _check(path: Path) -> None:
    if not path.exists():
        if path.is_symlink():
            raise FileNotFoundError(f"Checkpoint {path} points to a directory that is gone ({os.readlink(path)}). "
                                    "Restore an older checkpoint, or delete the link to start over.")
        raise FileNotFoundError(f"No checkpoint at {path}. Check the path (or that a save finished).")
    if path.is_dir() and not (path / _STATE).is_file() and (path / integrity.DIGESTS).is_file():
        raise integrity.damaged(path, _STATE, "is missing")
    if path.is_dir() and not (path / _STATE).is_file():
        hint = (" It looks like a checkpoint of an older towers (extra.pt); load it with that version."
                if (path / "extra.pt").is_file() else "")
        raise CheckpointError(f"{path} is not a towers checkpoint (expected a directory with {_STATE}).{hint}")


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return the plain values the chief wrote with the checkpoint (``weights_only=True``), manifest included.

    ``state.pt`` is checked against the checkpoint's ``checksums.json`` before it is parsed; a
    checkpoint of an older towers, without one, loads unchecked (said once, at INFO).

    Raises:
        FileNotFoundError: when there is nothing at ``path``.
        CorruptCheckpointError: when ``state.pt`` or ``checksums.json`` is missing, unreadable or changed.
        CheckpointError: when ``path`` is not a towers checkpoint, or one this version cannot read.
    """
    path = Path(path)
    _check(path)
    if path.is_file():
        return _legacy_file(path)
    table = integrity.read_table(path)
    data = integrity.read_verified(path, _STATE, table)
    if not data:
        raise integrity.damaged(path, _STATE, "is empty (0 bytes)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise integrity.damaged(path, _STATE, f"cannot be parsed ({_one_line(exc)})") from None
    if isinstance(state, dict) and state.get("checksums") is not None and table is None:
        raise integrity.damaged(path, integrity.DIGESTS, "is missing (this checkpoint was written with checksums)")
    if table is None and isinstance(state, dict) and state.get("format") == FORMAT:
        log.info("checkpoint %s was written without checksums (by an older towers): its files cannot be verified",
                 path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path / _STATE} was not written by towers; the checkpoint is foreign.")
    version = state.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < FORMAT_VERSION:
        raise CheckpointError(f"Checkpoint {path} has format version {version!r}; this towers reads version "
                              f"{FORMAT_VERSION}. Use the towers version that wrote it.")
    return state


def _legacy_file(path: Path) -> dict[str, Any]:
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path} is not a towers checkpoint and cannot be read as a torch file "
                              f"({type(exc).__name__}). A towers checkpoint is a directory.") from None
    if isinstance(value, dict) and value.get("format") == FORMAT:
        raise CheckpointError(f"{path} is a single-file checkpoint of an older towers (format version "
                              f"{value.get('version')!r}). Its weights load with torch.load(path, weights_only=True)"
                              "['model']; resuming from it needs the towers version that wrote it.")
    raise CheckpointError(f"{path} is not a towers checkpoint (a plain torch file). A plain state_dict loads with "
                          "model.load_state_dict(torch.load(path, weights_only=True)).")


def tensor_metadata(path: str | os.PathLike[str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Return ``{flat name: (global shape, dtype)}`` of the tensors in the checkpoint at ``path``.

    Raises:
        CorruptCheckpointError: when ``.metadata`` is unreadable, changed, or missing but listed in the checksums.
    """
    path = Path(path)
    table = integrity.read_table(path)
    if not (path / ".metadata").is_file() and (table is None or ".metadata" not in table):
        return {}
    metadata = _load_metadata(path, ".metadata", table)
    out = {}
    for key, item in metadata.state_dict_metadata.items():
        if hasattr(item, "size") and hasattr(item, "properties"):
            out[key] = (tuple(item.size), item.properties.dtype)
    return out


def read_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], *, io: CheckpointIO) -> None:
    """Fill ``tensors`` (flat names -> tensors or DTensors laid out for this job) from the checkpoint at ``path``.

    Every process of a ``collective`` strategy calls it; otherwise each reads alone. Each process
    checks every file it reads against the checkpoint's checksums first; DCP gathers a failure on
    any process to all of them, so every process raises the same error.

    Raises:
        CorruptCheckpointError: when a file it reads is missing, unreadable or changed since it was written.
        CheckpointError: when the files do not hold those tensors (torn or foreign).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    if not tensors:
        return
    table = integrity.read_table(path)
    no_dist = not torch.distributed.is_initialized() or not io.collective
    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=_reader(path, table), planner=_planner(),
                     process_group=io.process_group if not no_dist else None, no_dist=no_dist)
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as exc:
        corrupt = _corruption(exc)
        if corrupt is not None:
            raise CorruptCheckpointError(corrupt) from None
        raise CheckpointError(f"Checkpoint {path} cannot be read: {_root_cause(exc)}. Its files are torn or were "
                              "changed after it was written; restore an older checkpoint.") from None


def delete(path: str | os.PathLike[str]) -> None:
    """Remove the checkpoint at ``path``: the link and the directory it points to (nothing if absent)."""
    link = Path(path)
    target = link.resolve() if link.is_symlink() else None
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link, ignore_errors=True)
    if target is not None and target.is_dir():
        shutil.rmtree(target, ignore_errors=True)


def _failures(exc: BaseException) -> list[BaseException]:
    """The exceptions of each process inside DCP's ``CheckpointException`` (``(exception, traceback)`` pairs), or ``[exc]``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        return [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    return [exc]


def _corruption(exc: BaseException) -> str | None:
    """The message of a ``CorruptCheckpointError`` raised by any process inside DCP, or None."""
    found = [f for f in _failures(exc) if isinstance(f, CorruptCheckpointError)]
    return str(found[0]) if found else None


def _one_line(exc: BaseException) -> str:
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    fallback = "the data ends early" if isinstance(exc, EOFError) else "(no message)"
    return f"{type(exc).__name__}: {text[-1].strip() if text else fallback}"


def _root_cause(exc: BaseException) -> str:
    return "; ".join(_one_line(f) for f in _failures(exc)[:2])
