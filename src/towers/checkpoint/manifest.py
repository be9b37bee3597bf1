"""The manifest of a checkpoint: ``state.pt``, the chief's plain values, checked and read without ``pickle``."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from towers._logging import get_logger
from towers.checkpoint import integrity
from towers.checkpoint.dcp_support import one_line
from towers.checkpoint.files import FORMAT, FORMAT_VERSION, STATE_FILE
from towers.checkpoint.state import CheckpointError
from towers.errors import NotFoundError

__all__ = ["read_manifest"]

log = get_logger(__name__)


def _check(path: Path) -> None:
    if not path.exists():
        if path.is_symlink():
            raise NotFoundError(f"Checkpoint {path} points to a directory that is gone ({os.readlink(path)}). "
                                    "Restore an older checkpoint, or delete the link to start over.")
        raise NotFoundError(f"No checkpoint at {path}. Check the path (or that a save finished).")
    if path.is_dir() and not (path / STATE_FILE).is_file() and (path / integrity.DIGESTS).is_file():
        raise integrity.damaged(path, STATE_FILE, "is missing")
    if path.is_dir() and not (path / STATE_FILE).is_file():
        hint = (" It looks like a checkpoint of an older towers (extra.pt); load it with that version."
                if (path / "extra.pt").is_file() else "")
        raise CheckpointError(f"{path} is not a towers checkpoint (expected a directory with {STATE_FILE}).{hint}")


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
    data = integrity.read_verified(path, STATE_FILE, table)
    if not data:
        raise integrity.damaged(path, STATE_FILE, "is empty (0 bytes)")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise integrity.damaged(path, STATE_FILE, f"cannot be parsed ({one_line(exc)})") from None
    if isinstance(state, dict) and state.get("checksums") is not None and table is None:
        raise integrity.damaged(path, integrity.DIGESTS, "is missing (this checkpoint was written with checksums)")
    if table is None and isinstance(state, dict) and state.get("format") == FORMAT:
        log.info("checkpoint %s was written without checksums (by an older towers): its files cannot be verified",
                 path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path / STATE_FILE} was not written by towers; the checkpoint is foreign.")
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
