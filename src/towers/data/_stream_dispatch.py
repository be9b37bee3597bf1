"""A ``DistributedStream`` whose batches are handed out at run time (parameter servers): ps task 0 gives each
replica units of global batches (its own shares first, a dead replica's after)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

import torch

from towers.data._batch import BatchInfo, JobPosition, attach_batch_info, global_batch_sizes, pass_examples, to_device
from towers.data._shard_files import ShardFiles, content_digest
from towers.data._stream_position import Position
from towers.data._stream_reading import BatchReader, Transform, Work

__all__ = ["StreamDispatch"]


class StreamDispatch:
    """The part of ``DistributedStream`` that reads units handed out at run time (a base class: its state is the
    stream's)."""

    global_batch_size: int
    drop_remainder: bool
    pad_empty_batches: bool
    num_replicas: int
    device: torch.device
    in_ledger: bool
    _dispatch: Any
    _passes: int
    _epoch: int
    _position: Position
    _num_examples: int | None
    _counted_files: str | None
    _examples_trained: int | None
    _transform: Transform

    if TYPE_CHECKING:
        @property
        def num_virtual_shards(self) -> int: ...
        def _records(self, files: list[ShardFiles] | None,
                     cursors: list[int] | None = None) -> Iterator[tuple[int, int, Any]]: ...
        def _check_epoch(self, consumed: int, ahead: int, exhausted: bool) -> None: ...
        def _share(self, records: list[tuple[int, int, Any]], info: BatchInfo,
                   replica_id: int | None = None) -> tuple[Work, BatchInfo]: ...

    def _dispatched(self, start: int, files: list[ShardFiles] | None) -> Iterator[Any]:
        """Yield the units ps task 0 hands this replica (its own shares first, a dead replica's after).

        The dispatcher needs the epoch's size: the stream is counted once (its records read, none
        transformed), and again when its files changed (then every worker sends ps task 0, which
        compares the workers' specs, the new count). A unit's records are read forward; a unit of an
        earlier global batch (a dead replica's) reads the epoch again from its start.
        """
        B = self.global_batch_size
        digest = None if files is None else content_digest(files)
        if self._num_examples is None or digest != self._counted_files:
            self._num_examples = sum(1 for _ in self._records(files))
            self._counted_files = digest
        n = self._num_examples
        self._check_epoch(0, n, True)
        sizes = global_batch_sizes(n, B, drop_remainder=self.drop_remainder)
        spec: dict[str, Any] = {"num_examples": n, "global_batch_size": B, "drop_remainder": self.drop_remainder,
                                "start": start, "epoch": self._epoch, "num_replicas": self.num_replicas}
        if self.in_ledger:  # units are read in the stream's order: a position is a record's place in it
            spec["order"] = {"seed": 0, "shuffle": False}
        self._passes += 1
        key = f"{self._dispatch.name}.{self._passes}"  # this pass's name, the same on every replica
        reader = BatchReader(lambda: self._records(files), B)
        step = 0
        while True:
            answer = self._dispatch(key, step, spec)
            if answer["kind"] == "stop":  # counted from `start`: a resumed epoch trained the batches before it
                self._examples_trained = pass_examples(answer, sum(sizes[:start]), self._epoch)
                break
            units = [(int(g), int(r)) for g, r in answer["units"]] if answer["kind"] == "unit" else [(len(sizes) - 1, -1)]
            for g, r in units:
                records = reader.batch(g, sizes[g]) if r >= 0 else [reader.first()]
                info = BatchInfo(g, len(sizes), sizes[g], 0, 0, sizes[g], 1, True,
                                 unit=(key, g, r) if r >= 0 else None)
                if r < 0:  # an empty step: no example, the same step count as the replicas still working
                    work: Work = ([records[0]], not self.pad_empty_batches)
                    info = replace(info, num_padding_examples=1 if self.pad_empty_batches else 0)
                else:
                    work, info = self._share(records, info, r)
                batch = self._transform(work)
                position = JobPosition(self._epoch, start + step)  # this replica's own count: units come in any order
                step += 1
                self._position.batch = max(self._position.batch, g + 1)
                yield attach_batch_info(to_device(batch, self.device), replace(info, epoch=self._epoch,
                                                                                  position=position))
        self._epoch += 1
        self._position = Position.start(self.num_virtual_shards)
