"""Library logging: loggers under ``towers.*`` that propagate, and rank-prefixed output for towers' own runs.

The library adds only a ``NullHandler``: an application routes towers' lines like any other
library's (``logging.basicConfig``, its own handlers). ``configure_logging`` is what the
``towers`` command and ``towers launch`` use for their own runs: lines carry ``[rank r/w]``
and only the chief emits INFO and DEBUG (warnings and errors come from every rank, since a
problem on rank 3 must not be swallowed).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["get_logger", "set_rank", "all_ranks_log", "configure_logging", "configured_logging", "RankFilter"]

_ROOT = "towers"
logging.getLogger(_ROOT).addHandler(logging.NullHandler())


class _RankState:
    rank = 0
    world_size = 1
    all_ranks = False


class RankFilter(logging.Filter):
    """Adds ``record.rank_prefix`` (``[rank r/w]``) and drops a non-chief rank's INFO/DEBUG lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank {_RankState.rank}/{_RankState.world_size}]"
        if _RankState.rank != 0 and not _RankState.all_ranks:
            return record.levelno >= logging.WARNING
        return True


def configure_logging(level: int | str = logging.INFO, *, stream: TextIO | None = None,
                      all_ranks: bool = False) -> logging.Handler:
    """Print towers' log lines to ``stream`` (stderr) as ``[rank r/w] LEVEL name: message``; return the handler.

    For the ``towers`` command, ``towers launch`` and scripts that want towers' own output. Calling
    it again replaces the handler it installed. The ``towers`` logger then stops propagating, so
    a line is not printed twice through a root handler.
    """
    root = logging.getLogger(_ROOT)
    for handler in list(root.handlers):
        if getattr(handler, "_towers_handler", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(rank_prefix)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RankFilter())
    handler._towers_handler = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    all_ranks_log(all_ranks)
    return handler


def configured_logging() -> bool:
    """Return True when ``configure_logging`` set up towers' output in this process."""
    return any(getattr(h, "_towers_handler", False) for h in logging.getLogger(_ROOT).handlers)


def get_logger(name: str) -> logging.Logger:
    """Return the library logger for module ``name`` (a child of the ``towers`` logger)."""
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def set_rank(rank: int, world_size: int) -> None:
    """Tell the output ``configure_logging`` set up which replica this process is, for the ``[rank r/w]`` prefix."""
    _RankState.rank = int(rank)
    _RankState.world_size = int(world_size)


def all_ranks_log(enabled: bool = True) -> None:
    """Let every rank (not only the chief) emit INFO lines through ``configure_logging``'s output; useful when debugging."""
    _RankState.all_ranks = bool(enabled)
