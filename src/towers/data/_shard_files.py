"""Fingerprints of a stream's file shards, so that a file that changes under a job is an error, never a short epoch.

A ``Shards`` entry names files when it is a path (``str`` or ``os.PathLike``) of a regular file,
or a tuple or list holding such paths (``("part-0.tar", "part-0.idx")``): the reader is the
user's, so towers fingerprints the files the entry names, not what the reader does with them.
Other entries (URLs, numbers, Hugging Face shards) and torch ``IterableDataset`` streams have
no file to fingerprint.

A file's fingerprint is its size, its modification time (``st_mtime_ns``) and a SHA-256 of its
first and last 4 KiB: a ``stat`` and two small reads, whatever the file's size. It is taken
when an epoch opens its shards, and used three ways:

* when a shard's reader ends, the files are fingerprinted again and must be unchanged: a file
  truncated, grown, or written to in place (its time moved) while it was read is an error, and so
  is one replaced by a file of another size or other edges (a file replaced by one with the same
  size and edges, as concurrent writers of the same data do with ``os.replace``, is accepted: a
  reader that opened the old one reads it whole);
* the size and the SHA-256 (not the time: a copy on another host, or a fresh download, has its
  own) are saved with a mid-epoch position and compared when it is resumed;
* replicas compare the same size and SHA-256 per shard before an epoch starts.

It catches any change of size, any write in place while the file is read (the time moves), and
a rewrite whose first or last 4 KiB differ. It misses a same-size change confined to the middle
of the file made between a save and its resume, between two replicas' copies, or by replacing
the file while it is read (the time is not compared there), and an in-place write that puts the
time back (``touch -d``).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from towers.errors import TowersError, user_error

__all__ = ["ShardChangedError", "FileFingerprint", "ShardFiles", "names_files", "shard_files", "check_read",
           "as_state", "check_resumed", "agreement_vector", "check_agreement", "content_digest"]

EDGE_BYTES = 4096  # hashed at the start and at the end of each file


class ShardChangedError(TowersError, RuntimeError):
    """A file shard of a stream changed while read, between a save and its resume, or differs between replicas."""


@dataclass(frozen=True)
class FileFingerprint:
    """A file as an epoch opened it: ``path``, ``size`` in bytes, ``mtime_ns``, ``edges`` (SHA-256 of its edges).

    ``file_id``: ``(st_dev, st_ino)``, which file system object the path named (local, like the time).
    """

    path: str
    size: int
    mtime_ns: int
    edges: str
    file_id: tuple[int, int] = (0, 0)

    def content(self) -> list[Any]:
        """``[path, size, edges]``: what a copy of the file elsewhere shares (a checkpoint keeps this)."""
        return [self.path, self.size, self.edges]


ShardFiles = tuple[FileFingerprint, ...]  # the files one Shards entry names (empty: none)


def _paths(item: Any) -> list[str]:
    """The paths a ``Shards`` entry could name (files or not)."""
    parts = list(item) if isinstance(item, (tuple, list)) else [item]
    return [os.fsdecode(os.fspath(p)) for p in parts if isinstance(p, (str, os.PathLike))]


def names_files(items: Sequence[Any]) -> bool:
    """Whether any entry may name a file (decided from the entries' types: the same on every replica)."""
    return any(_paths(item) for item in items)


def fingerprint(path: str) -> FileFingerprint | None:
    """Return the fingerprint of ``path`` now; None when it is not a regular file (missing, a directory, a pipe)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            digest = hashlib.sha256(f.read(EDGE_BYTES))
            if st.st_size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
                digest.update(f.read(EDGE_BYTES))
    except OSError:
        return None
    return FileFingerprint(path, st.st_size, st.st_mtime_ns, digest.hexdigest()[:16], (st.st_dev, st.st_ino))


def shard_files(item: Any) -> ShardFiles:
    """Fingerprint the regular files a ``Shards`` entry names (empty when it names none)."""
    found = (fingerprint(p) for p in _paths(item))
    return tuple(f for f in found if f is not None)


def _change(before: list[Any], after: FileFingerprint | None, *, opened: FileFingerprint | None = None) -> str | None:
    """How a file changed from ``before`` (``[path, size, edges]``) to ``after``; None when it did not.

    ``opened``: the fingerprint taken in this process; then a write in place (the same file, its
    time moved) is a change too.
    """
    path, size, edges = before
    if after is None:
        return f"{path} is gone (no regular file there now)"
    if after.size < size:
        return f"{path} shrank from {size} to {after.size} bytes"
    if after.size > size:
        return f"{path} grew from {size} to {after.size} bytes"
    if after.edges != edges:
        return f"{path} kept its size ({size} bytes) but its first or last {EDGE_BYTES // 1024} KiB changed"
    if opened is not None and after.file_id == opened.file_id and after.mtime_ns != opened.mtime_ns:
        return f"{path} kept its size ({size} bytes) but was written to (its mtime moved from {opened.mtime_ns} " \
               f"to {after.mtime_ns})"
    return None


def _changes(before: Sequence[list[Any]], now: ShardFiles, opened: ShardFiles | None = None) -> list[str]:
    now_by_path = {f.path: f for f in now}
    out = [c for i, b in enumerate(before)
           if (c := _change(b, now_by_path.get(b[0]), opened=None if opened is None else opened[i]))]
    known = {b[0] for b in before}
    out += [f"{f.path} appeared ({f.size} bytes)" for f in now if f.path not in known]
    return out


def _shown(before: Sequence[Any], now: ShardFiles) -> str:
    """The first file of ``before`` (``[path, size, edges]`` each) as it was and as it is now, for an error."""
    if not before and not now:
        return "no file"
    path, size, edges = before[0] if before else (now[-1].path, -1, "")
    after = next((f for f in now if f.path == path), None)
    was = f"{size} bytes, edges sha256 {edges}" if size >= 0 else "no file"
    is_ = f"{after.size} bytes, edges sha256 {after.edges}, mtime_ns {after.mtime_ns}" if after else "no file"
    return f"{path}: {was} then; {is_} now"


def check_read(v: int, item: Any, opened: ShardFiles, epoch: int) -> None:
    """Check, when shard ``v``'s reader ended, that its files are still what the epoch opened.

    Raises:
        ShardChangedError: naming the shard, the file and how it changed (shrank, grew, rewritten).
    """
    now = shard_files(item)
    changes = _changes([f.content() for f in opened], now, opened)
    if changes:
        raise user_error(
            f"Shard {v} ({item!s}) changed while the stream read it in epoch {epoch}: {'; '.join(changes)}. "
            "Its reader may have ended early or read a mix of two versions, so the epoch would silently miss or "
            "repeat examples", _shown([f.content() for f in opened], now),
            "Do not change a file while a job reads it: write new data to new files (and pass them to a later "
            "run), then resume from the last checkpoint.", cls=ShardChangedError)


def as_state(files: Sequence[ShardFiles]) -> list[list[list[Any]]]:
    """The files' portable part per shard (``[[path, size, edges], ...]``), as a stream's ``state_dict`` keeps it."""
    return [[f.content() for f in shard] for shard in files]


def check_resumed(saved: Sequence[Sequence[Sequence[Any]]], now: Sequence[ShardFiles], name: Callable[[int], str],
                  epoch: int, examples: int) -> None:
    """Check that the files of a resumed position are the ones it was saved with (sizes and edges, not times).

    Raises:
        ShardChangedError: naming the first shard that changed, the file and how (and how many others did).
        ValueError: when ``saved`` does not have one entry per shard.
    """
    if len(saved) != len(now):
        raise user_error(f"A stream position's files need one entry per shard ({len(now)})", len(saved),
                         "Pass the dict state_dict() returned, unchanged.")
    changed = [(v, c) for v in range(len(now)) if (c := _changes([list(b) for b in saved[v]], now[v]))]
    if not changed:
        return
    v, changes = changed[0]
    others = f" ({len(changed) - 1} other shard(s) changed too)" if len(changed) > 1 else ""
    first = next((b for b in saved[v] if changes[0].startswith(f"{b[0]} ")), None)
    raise user_error(
        f"Shard {v} ({name(v)}) changed since this stream position was saved ({examples} examples into epoch "
        f"{epoch}): {'; '.join(changes)}{others}. The cursors count records of the files as they were, so the rest "
        "of the epoch would not be the rest of the same data", _shown([first] if first else [], now[v]),
        "Restore the files as they were when the checkpoint was written, or call set_epoch(epoch) instead of "
        "load_state_dict to start that epoch over on the files as they are now.", cls=ShardChangedError)


def content_digest(files: Sequence[ShardFiles]) -> str:
    """One hex digest of every shard's sizes and edges (not the paths or times: another host's copy has the same)."""
    text = repr([[(f.size, f.edges) for f in shard] for shard in files])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _key(shard: ShardFiles) -> int:
    """A 63-bit key of a shard's sizes and edges; 0 for a shard without files."""
    if not shard:
        return 0
    return int.from_bytes(hashlib.sha256(content_digest([shard]).encode()).digest()[:8], "big") >> 1 or 1


def agreement_vector(files: Sequence[ShardFiles]) -> torch.Tensor:
    """``[key, -key, size, -size]`` per shard (int64): its element-wise max over the replicas gives each max and min."""
    keys = torch.tensor([_key(s) for s in files], dtype=torch.long)
    sizes = torch.tensor([sum(f.size for f in s) if s else -1 for s in files], dtype=torch.long)
    return torch.cat([keys, -keys, sizes, -sizes])


def check_agreement(files: Sequence[ShardFiles], top: torch.Tensor, name: Callable[[int], str], epoch: int, *,
                    rank: int, num_replicas: int) -> None:
    """Check the max over the replicas of ``agreement_vector(files)``: every replica must see the same files.

    Every replica gets the same ``top``, so every replica raises the same error, before the epoch's first batch.

    Raises:
        ShardChangedError: naming the first shard whose files differ between replicas and how.
    """
    n = len(files)
    top = top.reshape(4, n).cpu()
    key_max, key_min, size_max, size_min = top[0], -top[1], top[2], -top[3]
    differ = [v for v in range(n) if key_max[v] != key_min[v]]
    if not differ:
        return
    v = differ[0]
    lo, hi = int(size_min[v]), int(size_max[v])
    if lo < 0:
        how = "it names no regular file on some replicas (missing there)"
    elif lo != hi:
        how = f"its size is {lo} bytes on some replicas and {hi} on others"
    else:
        how = f"it has the same size ({lo} bytes) everywhere but different first or last {EDGE_BYTES // 1024} KiB"
    mine = "; ".join(f"{f.path}: {f.size} bytes, edges sha256 {f.edges}" for f in files[v]) or "no file"
    others = f" ({len(differ) - 1} other shard(s) differ too: {differ[1:6]})" if len(differ) > 1 else ""
    raise user_error(
        f"[rank {rank}/{num_replicas}] The replicas see different files for shard {v} ({name(v)}) at the start "
        f"of epoch {epoch}: {how}{others}. They would split different sequences into batches and disagree on the "
        "number of batches", f"this replica's copy: {mine}",
        "Give every replica the same files (a shared file system, or the same copy on every host) and do not "
        "change them while a job reads them.", cls=ShardChangedError)
