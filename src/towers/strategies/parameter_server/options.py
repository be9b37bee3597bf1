"""A ParameterServerStrategy's options, checked before anything connects: update mode, staleness, timeout, overlap,
shared memory."""

from __future__ import annotations

from towers.errors import InvalidArgumentError, user_error

__all__ = ["MODES", "check_options"]

#: Update modes: ``async`` applies each gradient on arrival; ``sync`` one summed update per round; ``diloco``: workers
#: train on their own for ``sync_every`` steps, then the ps tasks apply an outer step to their parameter change.
MODES = ("async", "sync", "diloco")


def check_options(mode: str, staleness: int | None, *, timeout_s: float, overlap: bool, shared_memory: bool) -> None:
    """Raise ``ValueError`` for an unknown mode, a bad staleness or timeout, or overlap in sync mode (the strategy
    parses ``overlap`` and ``shared_memory`` with ``parse_flag`` first)."""
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}. Received: mode={mode!r}. Use 'async' to apply each "
                                   "gradient on arrival, 'sync' for one summed update per round, or 'diloco' for an "
                                   "outer step every sync_every local steps (slow links).")
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0):
        raise InvalidArgumentError(f"staleness must be None or an integer >= 0. Received: staleness={staleness!r}.")
    if staleness is not None and mode == "sync":
        raise InvalidArgumentError(f"staleness bounds async updates; sync mode is never stale. Received: mode='sync', "
                                   f"staleness={staleness}. Drop staleness or use mode='async'.")
    if timeout_s <= 0:
        raise InvalidArgumentError(f"timeout_s must be > 0 seconds. Received: {timeout_s}. Use e.g. timeout_s=300.")
    if overlap and mode == "sync":
        raise user_error("overlap is for async mode only (a sync round needs every reply before the "
                         "next step)", f"overlap={overlap!r} with mode={mode!r}",
                         "Pass overlap=True with mode='async', or leave it out.")
