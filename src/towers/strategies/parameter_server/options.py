"""A ParameterServerStrategy's options, checked before anything connects: update mode, staleness, timeout, overlap,
shared memory."""

from __future__ import annotations

from towers.errors import InvalidArgumentError, user_error
from towers.strategies.precision import Precision

__all__ = ["MODES", "check_options", "refuse_loss_scaling"]

#: Update modes: ``async`` applies each gradient on arrival; ``sync`` one summed update per round; ``diloco``: workers
#: train on their own for ``sync_every`` steps, then the ps tasks apply an outer step to their parameter change.
MODES = ("async", "sync", "diloco")


def check_options(mode: str, staleness: int | None, *, timeout_s: float, overlap: bool, shared_memory: bool) -> None:
    """Raise ``ValueError`` for an unknown mode, a bad staleness or timeout, or overlap in sync mode (the strategy
    parses ``overlap`` and ``shared_memory`` with ``parse_flag`` first)."""
    if isinstance(mode, str) and "," in mode and "=" in mode:
        raise user_error("each strategy option is one KEY=VALUE", f"mode={mode!r}",
                         "Give each its own flag: --strategy-option mode=diloco --strategy-option sync_every=8.")
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


def refuse_loss_scaling(precision: Precision) -> None:
    """Raise ``ValueError`` for fp16 (a loss scale): it must change in lockstep on every replica, which
    parameter-server updates do not do."""
    if precision.needs_loss_scaling:
        raise InvalidArgumentError(
            "ParameterServerStrategy computes in precision '32' or 'bf16'. Received: precision='fp16', whose "
            "loss scale must change in lockstep on every replica, which parameter-server updates do not do. "
            "Use precision='bf16' (no loss scaling needed) or MirroredStrategy for fp16.")
