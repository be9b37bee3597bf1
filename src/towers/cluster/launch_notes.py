"""Notes a process leaves for the ``towers launch`` that started it: files in the job's launch directory.

``towers launch`` makes one directory per job and names it in ``TOWERS_LAUNCH_DIR``
(``ProcessInfo.launch_dir``); a process says that something happened by writing a small file
there (no socket, nothing to wait for), and the launcher reads the directory when the job ends.
The notes: this process built a towers strategy, so ``towers launch --strategy`` was used; and
this process (its pid) finished its start-up, so the job can go on without it should it die later
(read by the parameter-server supervisor, ``towers.launch.supervise``).
"""

from __future__ import annotations

import os

from towers._logging import get_logger

__all__ = ["LAUNCH_DIR_VARIABLE", "note_strategy_built", "strategies_built", "note_started", "started_pid"]

log = get_logger(__name__)

#: The variable ``towers launch`` names the job's launch directory in.
LAUNCH_DIR_VARIABLE = "TOWERS_LAUNCH_DIR"

_STRATEGY_NOTE = "strategy-rank"
_STARTED_NOTE = "started-rank"


def note_strategy_built(launch_dir: str, *, rank: int, name: str) -> None:
    """Leave the note that process ``rank`` built strategy ``name`` (a note is advice: an error is only logged)."""
    try:
        with open(os.path.join(launch_dir, f"{_STRATEGY_NOTE}{rank}"), "w", encoding="utf-8") as fh:
            fh.write(name)
    except OSError as exc:
        log.debug("could not tell towers launch that a strategy was built (%s): %s", launch_dir, exc)


def strategies_built(launch_dir: str) -> dict[int, str]:
    """Return ``{rank: strategy name}`` of the processes that noted a strategy built in ``launch_dir``."""
    try:
        names = os.listdir(launch_dir)
    except OSError:
        return {}
    built: dict[int, str] = {}
    for file in names:
        rank = file[len(_STRATEGY_NOTE):]
        if file.startswith(_STRATEGY_NOTE) and rank.isdigit():
            try:
                with open(os.path.join(launch_dir, file), encoding="utf-8") as fh:
                    built[int(rank)] = fh.read().strip()
            except OSError:
                built[int(rank)] = ""
    return built


def note_started(launch_dir: str, *, rank: int) -> None:
    """Leave the note that process ``rank`` (this pid) finished its start-up (an error is only logged)."""
    path = os.path.join(launch_dir, f"{_STARTED_NOTE}{rank}")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    except OSError as exc:
        log.debug("could not tell towers launch that rank %d started (%s): %s", rank, launch_dir, exc)


def started_pid(launch_dir: str, rank: int) -> int | None:
    """Return the pid that last noted rank ``rank``'s start-up finished in ``launch_dir``, or None."""
    try:
        with open(os.path.join(launch_dir, f"{_STARTED_NOTE}{rank}"), encoding="utf-8") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None
