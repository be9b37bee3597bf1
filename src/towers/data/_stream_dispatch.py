"""A ``DistributedStream`` whose batches are handed out at run time (parameter servers): ps task 0 gives each
replica units of global batches (its own shares first, a dead replica's after); an object the stream holds."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from towers.data._batch import BatchInfo, JobPosition, attach_batch_info, global_batch_sizes, pass_examples, to_device
from towers.data._shard_files import ShardFiles, content_digest
from towers.data._stream_position import Position
from towers.data._stream_reading import BatchReader, Transform, Work

__all__ = ["RunTimeDispatch", "DispatchedPass"]


@dataclass
class DispatchedPass:
    """What one pass over a stream hands a ``RunTimeDispatch``: the stream's settings and its reading functions."""

    global_batch_size: int
    drop_remainder: bool
    pad_empty_batches: bool
    num_replicas: int
    device: torch.device
    in_ledger: bool
    epoch: int
    position: Position  # the stream's position, moved forward as units come
    records: Callable[[], Iterator[tuple[int, int, Any]]]  # the epoch's records in the stream's sequence
    check_epoch: Callable[[int, int, bool], None]
    share: Callable[..., tuple[Work, BatchInfo]]  # (records, info, replica_id) -> this replica's work and info
    transform: Transform


class RunTimeDispatch:
    """The units ps task 0 hands a ``DistributedStream`` at run time (parameter servers), and what it counted: an object
    the stream holds (None when its batches are split statically)."""

    def __init__(self, dispatch: Any):
        self.dispatch = dispatch  # towers.data.Dispatch: asks ps task 0 for this replica's next unit
        self.passes = 0  # passes started (names a dispatched pass, the same on every replica)
        self.num_examples: int | None = None  # counted once per content of the files, for the dispatcher
        self.counted_files: str | None = None  # the files' digest when they were counted
        self.examples_trained: int | None = None  # as ps task 0 counted the last complete dispatched pass

    def units(self, stream: DispatchedPass, start: int, files: list[ShardFiles] | None) -> Iterator[Any]:
        """Yield the units ps task 0 hands this replica (its own shares first, a dead replica's after).

        The dispatcher needs the epoch's size: the stream is counted once (its records read, none
        transformed), and again when its files changed (then every worker sends ps task 0, which
        compares the workers' specs, the new count). A unit's records are read forward; a unit of an
        earlier global batch (a dead replica's) reads the epoch again from its start.
        """
        B = stream.global_batch_size
        digest = None if files is None else content_digest(files)
        if self.num_examples is None or digest != self.counted_files:
            self.num_examples = sum(1 for _ in stream.records())
            self.counted_files = digest
        n = self.num_examples
        stream.check_epoch(0, n, True)
        sizes = global_batch_sizes(n, B, drop_remainder=stream.drop_remainder)
        spec: dict[str, Any] = {"num_examples": n, "global_batch_size": B, "drop_remainder": stream.drop_remainder,
                                "start": start, "epoch": stream.epoch, "num_replicas": stream.num_replicas}
        if stream.in_ledger:  # units are read in the stream's order: a position is a record's place in it
            spec["order"] = {"seed": 0, "shuffle": False}
        self.passes += 1
        key = f"{self.dispatch.name}.{self.passes}"  # this pass's name, the same on every replica
        reader = BatchReader(stream.records, B)
        step = 0
        while True:
            answer = self.dispatch(key, step, spec)
            if answer["kind"] == "stop":  # counted from `start`: a resumed epoch trained the batches before it
                self.examples_trained = pass_examples(answer, sum(sizes[:start]), stream.epoch)
                break
            units = [(int(g), int(r)) for g, r in answer["units"]] if answer["kind"] == "unit" else [(len(sizes) - 1, -1)]
            for g, r in units:
                records = reader.batch(g, sizes[g]) if r >= 0 else [reader.first()]
                info = BatchInfo(g, len(sizes), sizes[g], 0, 0, sizes[g], 1, True,
                                 unit=(key, g, r) if r >= 0 else None)
                if r < 0:  # an empty step: no example, the same step count as the replicas still working
                    work: Work = ([records[0]], not stream.pad_empty_batches)
                    info = replace(info, num_padding_examples=1 if stream.pad_empty_batches else 0)
                else:
                    work, info = stream.share(records, info, r)
                batch = stream.transform(work)
                position = JobPosition(stream.epoch, start + step)  # this replica's own count: units come in any order
                step += 1
                stream.position.batch = max(stream.position.batch, g + 1)
                yield attach_batch_info(to_device(batch, stream.device), replace(info, epoch=stream.epoch,
                                                                                    position=position))
