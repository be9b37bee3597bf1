"""Worker collectives through ps task 0: the k-th gather of every live worker meets there.

Workers never run collectives among themselves (a dead worker would break them in ``async``
mode). Instead each worker sends its k-th ``all_gather_object`` value to ps task 0, which
answers once every live worker has sent its k-th value. A worker that died or said goodbye
before sending is no longer waited for; one that sent and then died still counts.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["GatherTable"]


class GatherTable:
    """Pending and finished gathers, keyed by sequence number (guarded by the server's condition)."""

    def __init__(self, cond: threading.Condition, active: Callable[[], set[int]]):
        self._cond = cond
        self._active = active
        self._values: dict[int, dict[int, Any]] = {}
        self._results: dict[int, list[tuple[int, Any]]] = {}
        self._readers: dict[int, int] = {}

    def contribute(self, worker: int, seq: int, value: Any, *, wait: Callable[..., None]) -> list[tuple[int, Any]]:
        """Add ``worker``'s value to gather ``seq``; return ``[(worker, value), ...]`` once all live workers sent theirs."""
        with self._cond:
            if seq not in self._results:
                self._values.setdefault(seq, {})[worker] = value
                self.complete()
                wait(lambda: seq in self._results, f"gather #{seq}",
                     lambda: self._active() - set(self._values.get(seq, {})))
            result = self._results[seq]
            self._readers[seq] -= 1
            if self._readers[seq] <= 0:  # everyone who sent a value has its answer
                del self._results[seq], self._readers[seq]
            return result

    def complete(self) -> None:
        """Finish every gather that no live worker still owes a value to (caller holds the lock)."""
        live = self._active()
        for seq in sorted(self._values):
            values = self._values[seq]
            if live <= set(values):
                self._results[seq] = sorted(values.items())
                self._readers[seq] = len(values)
                del self._values[seq]
        self._cond.notify_all()
