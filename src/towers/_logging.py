"""Rank-aware logging for the library: every line carries ``[rank r/w]``.

By default only the chief (rank 0) emits INFO and DEBUG lines; warnings and errors are
emitted by every rank, since a problem on rank 3 must not be swallowed.
"""

from __future__ import annotations

import logging

__all__ = ["get_logger", "set_rank", "all_ranks_log"]

_ROOT = "towers"


class _RankState:
    rank = 0
    world_size = 1
    all_ranks = False


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank {_RankState.rank}/{_RankState.world_size}]"
        if _RankState.rank != 0 and not _RankState.all_ranks:
            return record.levelno >= logging.WARNING
        return True


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_towers_configured", False):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(rank_prefix)s %(levelname)s %(name)s: %(message)s"))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        # Our handler carries the rank prefix; do not print the same line twice through root.
        root.propagate = False
        root._towers_configured = True  # type: ignore[attr-defined]
    return root


def get_logger(name: str) -> logging.Logger:
    """Return the library logger for module ``name`` (a child of the ``towers`` logger)."""
    _configure_root()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def set_rank(rank: int, world_size: int) -> None:
    """Tell the logger which replica this process is, for the ``[rank r/w]`` prefix."""
    _RankState.rank = int(rank)
    _RankState.world_size = int(world_size)


def all_ranks_log(enabled: bool = True) -> None:
    """Let every rank (not only the chief) emit INFO lines; useful when debugging."""
    _RankState.all_ranks = bool(enabled)
