"""The tensor files of a checkpoint, read through ``torch.distributed.checkpoint`` safely.

Nothing read from a file is unpickled beyond plain data: DCP's ``.metadata`` is read by an
unpickler that admits only DCP's own metadata classes and torch's dtypes and sizes, and every file
DCP reads is checked against the checkpoint's checksums (``integrity.py``) first.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from towers.checkpoint import integrity
from towers.checkpoint.checkpoint_io import CheckpointIO
from towers.checkpoint.dcp_support import corruption, one_line, quiet_single_process, root_cause
from towers.checkpoint.state import CheckpointError, CorruptCheckpointError

__all__ = ["tensor_metadata", "read_tensors"]


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
        raise integrity.damaged(checkpoint, name, f"cannot be parsed ({one_line(exc)})") from None


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
                    raise integrity.damaged(checkpoint, name, f"cannot be read ({one_line(exc)})") from None
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
        with quiet_single_process():
            dcp.load(tensors, storage_reader=_reader(path, table), planner=_planner(),
                     process_group=io.process_group if not no_dist else None, no_dist=no_dist)
    except (CheckpointException, RuntimeError, ValueError, KeyError, OSError) as exc:
        corrupt = corruption(exc)
        if corrupt is not None:
            raise CorruptCheckpointError(corrupt) from None
        raise CheckpointError(f"Checkpoint {path} cannot be read: {root_cause(exc)}. Its files are torn or were "
                              "changed after it was written; restore an older checkpoint.") from None
