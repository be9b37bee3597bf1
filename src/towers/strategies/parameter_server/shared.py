"""Shared memory between a worker and a ps task on the same host: the dense push and pull skip the wire.

A worker makes two files in ``SHARED_DIR`` per ps shard, each the shard's flat size: one its
gradients are written into, one the ps writes the shard's parameters into (the worker's
parameters are views of it). The files are created with mode 0600, their pages reserved at once
(``posix_fallocate``: a full ``/dev/shm`` fails here, never later as a SIGBUS), and unlinked as
soon as the ps answered the registration. A process killed while it waits for that answer leaves
its files behind; the next worker on the host removes the files of towers processes that are gone
(``sweep``; a file of a live process in another PID namespace that shares this /dev/shm may be
taken for a dead one: its pair then keeps the wire, nothing else changes).

The ps maps them only when the path names a towers file in its own ``SHARED_DIR``, owned by its
user, of the expected size, holding the random token the registration carries: on another host
(or another container) the file is not there, and the link carries the bytes as before.

Who writes when: the worker writes its gradients, then sends a push; the ps reads them, updates,
writes the parameters, then replies; the worker reads them once the reply is in. Each side
touches the memory only while the other waits for its message.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass
from typing import Any

import torch

from towers._logging import get_logger
from towers.errors import InvalidArgumentError

__all__ = ["SHARED_DIR", "TOKEN_BYTES", "ROOM_SHARE", "SharedBuffer", "create", "attach", "new_token", "room", "sweep"]

log = get_logger(__name__)

#: Where the files live: the host's shared-memory file system.
SHARED_DIR = "/dev/shm"
#: Bytes at the start of the gradient file that prove the ps mapped the worker's file.
TOKEN_BYTES = 16
#: A worker takes at most this share of the free space: DataLoader workers pass their batches through
#: the same file system (a container's /dev/shm is 64 MB by default).
ROOM_SHARE = 1 / 8
_NAME = re.compile(r"^towers-ps-[0-9]+-[0-9a-f]{32}$")


@dataclass
class SharedBuffer:
    """One mapped file: its ``path`` and a ``uint8`` tensor over its bytes (valid while this object lives)."""

    path: str
    tensor: torch.Tensor
    _map: mmap.mmap

    def unlink(self) -> None:
        """Remove the file's name (the memory stays mapped until both sides drop it); idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def create(nbytes: int, directory: str = SHARED_DIR) -> SharedBuffer:
    """Return a new zeroed shared buffer of ``nbytes`` (> 0) in ``directory``.

    Raises:
        OSError: no such directory, or not room for ``nbytes`` in it.
    """
    if nbytes <= 0:
        raise InvalidArgumentError(f"a shared buffer needs > 0 bytes. Received: nbytes={nbytes}.")
    if not hasattr(os, "posix_fallocate"):
        raise OSError(errno.ENOTSUP, "this platform cannot reserve shared memory up front (no posix_fallocate)")
    path = os.path.join(directory, f"towers-ps-{os.getpid()}-{secrets.token_hex(16)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve every page now: ENOSPC here, not SIGBUS at a write
        mapped = mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return SharedBuffer(path, torch.frombuffer(mapped, dtype=torch.uint8), mapped)


def sweep(directory: str = SHARED_DIR) -> list[str]:
    """Remove this user's towers files in ``directory`` whose process is gone; return their paths."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _NAME.match(name):
            continue
        pid = int(name.split("-")[2])
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or _alive(pid):
                continue
            os.unlink(path)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
        removed.append(path)
    if removed:
        log.info("removed %d shared-memory file(s) left in %s by towers processes that are gone", len(removed),
                 directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def room(directory: str = SHARED_DIR) -> int:
    """Free bytes in ``directory``'s file system (0 when there is no such directory)."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def attach(path: Any, nbytes: int, token: Any = None, directory: str = SHARED_DIR) -> SharedBuffer | None:
    """Map a worker's file named ``path`` when it is a towers file of ``nbytes`` in ``directory`` (whose first
    bytes are ``token``, hex, when given); else return None (another host, another user, not a towers file)."""
    if not isinstance(path, str) or (token is not None and (not isinstance(token, str)
                                                            or len(token) != 2 * TOKEN_BYTES)):
        return None
    if os.path.dirname(path) != directory or not _NAME.match(os.path.basename(path)):
        return None
    try:
        expected = None if token is None else bytes.fromhex(token)
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes or info.st_uid != os.getuid():
            return None
        mapped = mmap.mmap(fd, nbytes)
    except OSError:
        return None
    finally:
        os.close(fd)
    if expected is not None and mapped[:TOKEN_BYTES] != expected:
        mapped.close()
        return None
    return SharedBuffer(path, torch.frombuffer(mapped, dtype=torch.uint8), mapped)


def new_token() -> str:
    """A random token (hex) for ``attach`` to check."""
    return secrets.token_hex(TOKEN_BYTES)
