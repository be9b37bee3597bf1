"""Each worker's output reaches the launcher's terminal in whole lines, each prefixed with its rank.

Workers that share the launcher's terminal write to it directly, so two ranks' ``print`` lines
can merge into one (``{...}{...}``), and torchrun's own ``--tee`` follower writes whatever part
of a line it finds at the end of a file, so a line still being written is split in two. Here every
worker's stdout and stderr go to files (torchrun's ``DefaultLogsSpecs`` layout:
``<log dir>/<run id>_<suffix>/attempt_<n>/<local rank>/stdout.log``), and one thread per shown
file copies *complete* lines to the launcher's own stdout or stderr, each line one ``write``
under one lock, prefixed ``[rank N]: `` (N: the worker's global rank).

torchrun's flags choose what is shown, as with torchrun: ``--redirects`` sends a stream to its file
only, ``--tee`` to the file and the terminal, ``--local-ranks-filter`` shows only those local ranks
(the others still write their files), ``--log-dir`` keeps the files (without it they live in a
temporary directory removed when the job ends).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import threading
from typing import Any, BinaryIO

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, LogsSpecs, Std, to_map

__all__ = ["WholeLineLogs"]

_LINE_END = re.compile(rb"(?<=\n)|(?<=\r)(?=[^\n])")
_EOF_POLL_S = 0.05  # how often a follower looks again at a file that has no new bytes (as torch's 0.1 s)


class _Follower:
    """Copy complete lines of one growing file to a binary stream until stopped and drained."""

    def __init__(self, path: str, dst: BinaryIO, prefix: bytes, lock: threading.Lock, stop: threading.Event):
        self._path, self._dst, self._prefix, self._lock, self._stop = path, dst, prefix, lock, stop
        self.thread = threading.Thread(target=self._run, name=f"towers-output-{path}", daemon=True)
        self.thread.start()

    def _emit(self, line: bytes) -> None:
        with self._lock:
            self._dst.write(self._prefix + line)
            self._dst.flush()

    def _run(self) -> None:
        pending = b""
        handle = None
        while handle is None:
            try:
                handle = open(self._path, "rb")  # noqa: SIM115  # closed below
            except FileNotFoundError:
                if self._stop.wait(_EOF_POLL_S):
                    try:
                        handle = open(self._path, "rb")  # noqa: SIM115
                    except OSError:
                        return
            except OSError:
                return
        with handle:
            while True:
                chunk = handle.read(65536)
                if chunk:
                    pending += chunk
                    # A line ends at "\n", or at a "\r" that is not part of "\r\n" (a progress bar redrawing
                    # itself); a "\r" at the very end waits for the next byte to tell which.
                    *lines, pending = _LINE_END.split(pending)
                    for line in lines:
                        self._emit(line)
                    continue
                if self._stop.is_set():  # stopped and nothing more to read: the writers are gone
                    if pending:
                        self._emit(pending + b"\n")
                    return
                self._stop.wait(_EOF_POLL_S)


def _torchrun_flags(user: Any) -> tuple[str | None, Any, Any, Any]:
    """torchrun's ``DefaultLogsSpecs`` ``user``: the log directory it made, and its redirects, tee and rank filter."""
    # torch's LogsSpecs keeps the flags it was built with in private attributes only (no public getters); the
    # directory too (its root_log_dir property would turn a missing one into the string "None").
    return (getattr(user, "_root_log_dir", None), user._redirects, user._tee, user._local_ranks_filter)


class WholeLineLogs(LogsSpecs):
    """torchrun's logs spec for ``towers launch``: files for every stream, whole prefixed lines on the terminal.

    ``user`` is the spec ``config_from_args`` built from torchrun's flags (its ``--log-dir``,
    ``--redirects``, ``--tee`` and ``--local-ranks-filter``). Call ``close`` once the workers are gone.
    """

    def __init__(self, *, log_dir: str | None, redirects: Std | dict[int, Std], tee: Std | dict[int, Std],
                 local_ranks_filter: set[int] | None = None):
        self._keep = log_dir is not None
        root = log_dir if log_dir is not None else tempfile.mkdtemp(prefix="towers-logs-")
        super().__init__(log_dir=root, redirects=redirects, tee=tee, local_ranks_filter=local_ranks_filter)
        self._files = DefaultLogsSpecs(log_dir=root, redirects=Std.ALL, tee=Std.NONE)
        self._root = root
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._followers: list[_Follower] = []

    @classmethod
    def from_torchrun(cls, user: Any, *, log_dir: str | None) -> "WholeLineLogs":
        """Return the spec for the same flags as torchrun's ``DefaultLogsSpecs`` ``user``; ``log_dir``: ``--log-dir``.

        The temporary directory torchrun's spec made when no ``--log-dir`` was given is removed (if empty).
        """
        made, redirects, tee, local_ranks_filter = _torchrun_flags(user)
        if not log_dir and made and os.path.isdir(made) and not os.listdir(made):
            os.rmdir(made)
        return cls(log_dir=log_dir or None, redirects=redirects, tee=tee, local_ranks_filter=local_ranks_filter)

    @property
    def root_log_dir(self) -> str:  # noqa: D102
        return self._root

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Return every stream's file for this attempt, and start following the ones shown on the terminal."""
        self._stop_followers()
        dest = self._files.reify(envs)
        nprocs = len(envs)
        redirects, tees = to_map(self._redirects, nprocs), to_map(self._tee, nprocs)
        for local_rank in range(nprocs):
            if self._local_ranks_filter and local_rank not in self._local_ranks_filter:
                continue
            rank = envs[local_rank].get("RANK", str(local_rank))
            prefix = f"[rank {rank}]: ".encode()
            shown = ~redirects[local_rank] | tees[local_rank]
            for stream, files, dst in ((Std.OUT, dest.stdouts, sys.stdout), (Std.ERR, dest.stderrs, sys.stderr)):
                if shown & stream == stream and files.get(local_rank):
                    self._followers.append(_Follower(files[local_rank], dst.buffer, prefix, self._lock, self._stop))
        return LogsDest(stdouts=dest.stdouts, stderrs=dest.stderrs, tee_stdouts={}, tee_stderrs={},
                        error_files=dest.error_files)

    def _stop_followers(self) -> None:
        self._stop.set()
        for follower in self._followers:
            follower.thread.join(timeout=5.0)
        self._followers = []
        self._stop = threading.Event()

    def close(self) -> None:
        """Copy what the workers left in their files, stop following, and remove the files unless kept."""
        self._stop_followers()
        if not self._keep:
            shutil.rmtree(self._root, ignore_errors=True)
