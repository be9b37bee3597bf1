"""Where a checkpoint's files lie: the published link, the directory it points to, the chief's ``state.pt``.

``layout.py`` describes the format as a whole; this module names its places and finds or removes a
checkpoint, without torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["FORMAT", "FORMAT_VERSION", "STATE_FILE", "data_dir_for", "is_checkpoint", "is_published", "delete"]

#: The chief's file: the manifest and every plain value of the state.
STATE_FILE = "state.pt"
FORMAT = "towers.checkpoint"
FORMAT_VERSION = 2


def data_dir_for(path: Path, uid: str) -> Path:
    """Return the directory a save with id ``uid`` writes, beside the link ``path`` that will point to it."""
    return path.parent / f".{path.name}.{uid}"


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Return True when a complete checkpoint is published at ``path`` (a directory with its ``state.pt``)."""
    p = Path(path)
    return p.is_dir() and (p / STATE_FILE).is_file()


def is_published(path: str | os.PathLike[str]) -> bool:
    """Return True when a checkpoint was published at ``path`` (its link or directory is there), complete or damaged.

    A save publishes in one step, after every file is written: a published checkpoint without its
    ``state.pt`` (or whose link points nowhere) is damaged, not one being written.
    """
    p = Path(path)
    return p.is_symlink() or p.is_dir()


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
