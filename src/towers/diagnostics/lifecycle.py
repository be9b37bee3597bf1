"""One watchdog per process: ``start_watchdog`` when the process group exists, ``stop_watchdog`` when it goes.

The watchdog is per process, as the process group and torch's flight recorder are.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.diagnostics import progress as _progress
from towers.diagnostics.named import publish_exit
from towers.diagnostics.watchdog import DEFAULT_FACTOR, DEFAULT_MIN_S, Watchdog

__all__ = ["start_watchdog", "stop_watchdog", "current_watchdog", "named_store", "take_verdict"]

log = get_logger(__name__)

_current: Watchdog | None = None
_step_hook: Any = None  # the optimizer-step hook that feeds the current watchdog's progress
_named_store: Any = None  # the main thread's client for collectives every replica must call (named_store)


def _store_client(info: ProcessInfo, timeout_s: float) -> Any:
    import torch.distributed as dist

    # A client of its own: the main thread may hold the process group's client in a long store wait.
    host = "127.0.0.1" if info.rank == 0 and not info.agent_store else info.master_addr  # as process_group does
    store = dist.TCPStore(host, int(info.master_port),  # type: ignore[arg-type]
                          is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"towers/attempt_{info.restart_count}/watchdog", store)


def start_watchdog(info: ProcessInfo, *, min_s: float | None = None, factor: float = DEFAULT_FACTOR,
                   report_dir: str | os.PathLike[str] | None = None) -> Watchdog | None:
    """Start this process's watchdog for the job of ``info`` and return it (None when there is nothing to watch).

    ``min_s`` (default ``info.stuck_timeout_s``, else ``DEFAULT_MIN_S``) is the least time one wait may
    last; ``0`` turns the watchdog off. Replaces a watchdog this process already runs.
    Call it once the job's process group exists (its rendezvous store must be up).
    """
    global _current, _step_hook
    stop_watchdog()
    if min_s is None:
        min_s = info.stuck_timeout_s if info.stuck_timeout_s is not None else DEFAULT_MIN_S
    if info.world_size < 2 or info.master_port is None or min_s == 0:
        return None
    if info.num_ps and info.rank >= info.world_size - info.num_ps:
        _progress.set_role("ps")
    try:
        store = _store_client(info, timeout_s=min(10.0, max(2.0, float(min_s) / 6)))
    except Exception as exc:  # noqa: BLE001 - no watchdog is better than no job
        log.warning("the stuck-job watchdog could not reach the rendezvous store (%s); stuck ranks will only be "
                    "seen through the process-group timeout", exc)
        return None
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _step_hook = register_optimizer_step_post_hook(_progress.PROGRESS.on_step)
    watchdog = Watchdog(info, store, min_s=float(min_s), factor=factor, report_dir=report_dir)
    _current = watchdog.start()
    atexit.register(_at_exit)  # after the process group's own exit hook: runs before it, the store still up
    log.debug("stuck-job watchdog: bound max(%g s, %g x slowest recent step), heartbeat every %g s", min_s, factor,
              watchdog.poll_s)
    return watchdog


def stop_watchdog() -> None:
    """Stop this process's watchdog, if one runs (idempotent)."""
    global _current, _step_hook, _named_store
    watchdog, _current = _current, None
    hook, _step_hook = _step_hook, None
    _named_store = None
    if watchdog is not None:
        watchdog.stop()
    if hook is not None:
        hook.remove()


def _at_exit() -> None:
    atexit.unregister(_at_exit)
    if _current is not None:
        publish_exit(_current.store, _current.info.rank, _current.progress)


def current_watchdog() -> Watchdog | None:
    """Return the watchdog this process runs, or None."""
    return _current


def named_store() -> Any | None:
    """Return this process's main-thread client of the watchdog's store, for collectives every replica must call.

    None while no watchdog runs (``towers.diagnostics.named`` then has no rescue to offer). A client of its
    own: the agreement waits in it, and the watchdog's thread must not queue behind that wait.
    """
    global _named_store
    if _current is None:
        return None
    if _named_store is None:
        try:
            _named_store = _store_client(_current.info, timeout_s=60.0)
        except Exception as exc:  # noqa: BLE001 - the caller agrees over its process group instead
            log.warning("could not reach the rendezvous store for a collective every replica must call (%s)", exc)
            return None
    return _named_store


def take_verdict() -> None:
    """Count this process among those that took the verdict on a collective not every replica called, before its
    main thread raises it (``Watchdog.take_verdict``); nothing without a watchdog."""
    if _current is not None:
        _current.take_verdict()
