"""Collectives every replica must call (``Metric.result()``), as the strategies see them: the block that marks one,
the check that every replica entered it, and the error when one did not.

The protocol (the store agreement, and the watchdogs' rescue that finds a replica waiting elsewhere within
seconds) is ``towers.diagnostics.named``'s; this module raises its verdicts as ``PartialCollectiveError``.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from typing import Any, Iterator

import torch.distributed as dist

from towers.diagnostics.lifecycle import named_store, take_verdict
from towers.diagnostics.named import StoreAgreement, describe, named_call, verdict_of
from towers.diagnostics.progress import PROGRESS
from towers.errors import TowersError
from towers.process_group import first_line

__all__ = ["PartialCollectiveError", "named_collective", "current_named_collective", "NamedAgreement"]


class PartialCollectiveError(TowersError, RuntimeError):
    """A named collective (``named_collective``) that not every replica called: the message names it and the fix."""


#: The collective the current block belongs to (``named_collective``), None outside one.
_OPERATION: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("towers_named_collective",
                                                                                     default=None)


def current_named_collective() -> tuple[str, str] | None:
    """Return ``(operation, fix)`` of the named collective the caller is in, or None."""
    return _OPERATION.get()


@contextlib.contextmanager
def named_collective(operation: str, fix: str) -> Iterator[None]:
    """Mark the strategy collectives of this block as ``operation``, which every replica must call.

    A collective that users tend to call on one replica only (``Metric.result()`` inside ``if
    strategy.is_chief:``) would otherwise pair with another replica's next collective (a gradient
    all-reduce: Gloo aborts the process on the size mismatch) or wait for it until a timeout. Inside
    this block ``ProcessGroupComm`` first checks, in the job's store, that every replica entered the
    same ``operation``. Under every strategy, a replica that waits elsewhere for this one is found by
    the watchdogs within seconds: it ends with the error, and this block raises it too.

    Raises:
        PartialCollectiveError: naming ``operation``, the rank that did not call it and where it waits, and ``fix``.
    """
    token = _OPERATION.set((operation, fix))
    try:
        with named_call(operation, fix) as call:
            try:
                yield
            except PartialCollectiveError:
                raise
            except Exception:  # a wait that broke because the rank that did not call it ended
                verdict = verdict_of(named_store(), call)
                if verdict is None:
                    raise
                raise _error(verdict) from None  # the cause, told
            verdict = verdict_of(named_store(), call)  # a wait that ended without that rank (parameter servers)
            if verdict is not None:
                raise _error(verdict)
    finally:
        _OPERATION.reset(token)


def _error(verdict: dict[str, Any]) -> PartialCollectiveError:
    """The verdict as this rank's error, once every process of the job could take it (``take_verdict``)."""
    take_verdict()
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    return PartialCollectiveError(describe(verdict, rank, size))


class NamedAgreement:
    """A ``ProcessGroupComm``'s check that all of its replicas entered the named call, in the job's store."""

    def __init__(self, *, rank: int, num_replicas: int, timeout_s: float, group: Any = None):
        self.rank, self.num_replicas, self.timeout_s, self.group = rank, num_replicas, timeout_s, group
        self._agreement: StoreAgreement | None = None

    def agree(self, operation: str, fix: str) -> bool:
        """Return True once every replica entered ``operation``; False when there is no store to agree in
        (no watchdog runs: a process group towers did not start), so that the caller agrees its own way.

        Raises:
            PartialCollectiveError: a replica did not call it (found by the watchdogs, with where it waits), or
                did not arrive within half of ``timeout_s``.
        """
        store, call = named_store(), PROGRESS.named
        if store is None or call is None:
            return False
        if self._agreement is None:
            ranks = "all" if self.group is None else "-".join(map(str, dist.get_process_group_ranks(self.group)))
            self._agreement = StoreAgreement(store, f"g{zlib.crc32(ranks.encode())}")
        bound_s = self.timeout_s / 2  # before a replica that went on gives up in its own collective
        try:
            verdict = self._agreement.agree(call, self.num_replicas, bound_s)
        except Exception as exc:  # noqa: BLE001 - torch's DistStoreError and kin (a timeout, a store gone)
            raise PartialCollectiveError(
                f"[rank {self.rank}/{self.num_replicas}] {operation} waited up to {bound_s:g} s for the other replicas "
                f"and not all of them called it ({first_line(exc)}). It is a collective: every replica must call it. "
                f"{fix}") from exc
        if verdict is not None:
            raise _error(verdict)
        return True
