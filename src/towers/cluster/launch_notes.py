"""Notes a process leaves for the ``towers launch`` that started it: files in the job's launch directory.

``towers launch`` makes one directory per job and names it in ``TOWERS_LAUNCH_DIR``
(``ProcessInfo.launch_dir``); a process says that something happened by writing a small file
there (no socket, nothing to wait for), and the launcher reads the directory when the job ends.
One note so far: this process built a towers strategy, so ``towers launch --strategy`` was used.
"""

from __future__ import annotations

import os

from towers._logging import get_logger

__all__ = ["LAUNCH_DIR_VARIABLE", "note_strategy_built", "strategies_built"]

log = get_logger(__name__)

#: The variable ``towers launch`` names the job's launch directory in.
LAUNCH_DIR_VARIABLE = "TOWERS_LAUNCH_DIR"

_STRATEGY_NOTE = "strategy-rank"


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
