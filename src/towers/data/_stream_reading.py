"""How a ``DistributedStream`` reads its records into batches: the records of a global batch read forward
(``BatchReader``) and a share's records made into its batch (``Transform``)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from towers.data._batch import map_tensors
from towers.errors import user_error

__all__ = ["BatchReader", "Transform", "Work"]

Work = tuple[list[tuple[int, int, Any]], bool]  # (records (virtual shard, offset, record), keep 0 rows only)


class BatchReader:
    """The records of global batch ``g`` of an epoch, read forward (from the start again for an earlier batch)."""

    def __init__(self, records: Callable[[], Iterator[tuple[int, int, Any]]], global_batch_size: int):
        self._open, self._b = records, global_batch_size
        self._records = records()
        self._next = 0  # the global batch the reader is at
        self._first: tuple[int, int, Any] | None = None

    def first(self) -> tuple[int, int, Any]:
        """The epoch's first record (the structure of an empty step's batch)."""
        if self._first is None:
            self._first = next(self._open())
        return self._first

    def batch(self, g: int, size: int) -> list[tuple[int, int, Any]]:
        if g < self._next:
            self._records, self._next = self._open(), 0
        for _ in range((g - self._next) * self._b):
            next(self._records)
        out = [next(self._records) for _ in range(size)]
        self._next = g + 1
        return out


class Transform:
    """Makes a share's batch from its records: ``transform`` each, collate (in the training process or a worker)."""

    def __init__(self, source: Any, collate: Callable[[list[Any]], Any]):
        self.source, self.collate = source, collate

    def __call__(self, work: Work) -> Any:
        records, structure_only = work
        batch = self.collate([self._example(r) for r in records])
        return map_tensors(batch, lambda t: t[:0]) if structure_only else batch

    def _example(self, record: tuple[int, int, Any]) -> Any:
        transform = self.source.transform
        if transform is None:
            return record[2]
        try:
            return transform(record[2])
        except Exception as exc:
            raise user_error(f"transform raised on {self.source.label(record[0], record[1])}",
                             f"{type(exc).__name__}: {exc}", "Fix the record or the transform.",
                             cls=RuntimeError) from exc
