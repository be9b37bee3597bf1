"""A ``DistributedStream`` whose batches are handed out at run time (parameter servers): ps task 0 gives each
replica units of global batches (its own shares first, a dead replica's after)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

from towers._batch import BatchInfo, JobPosition, attach_batch_info, global_batch_sizes, pass_examples, to_device
from towers._shard_files import ShardFiles, content_digest
from towers._stream_position import Position
from towers._stream_reading import BatchReader, Work

if TYPE_CHECKING:
    from towers.streams import DistributedStream

__all__ = ["dispatched_batches"]


def dispatched_batches(stream: DistributedStream, start: int, files: list[ShardFiles] | None) -> Iterator[Any]:
    """Yield the units ps task 0 hands this replica (its own shares first, a dead replica's after).

    The dispatcher needs the epoch's size: the stream is counted once (its records read, none
    transformed), and again when its files changed (then every worker sends ps task 0, which
    compares the workers' specs, the new count). A unit's records are read forward; a unit of an
    earlier global batch (a dead replica's) reads the epoch again from its start.
    """
    B = stream.global_batch_size
    digest = None if files is None else content_digest(files)
    if stream._num_examples is None or digest != stream._counted_files:
        stream._num_examples = sum(1 for _ in stream._records(files))
        stream._counted_files = digest
    n = stream._num_examples
    stream._check_epoch(0, n, True)
    sizes = global_batch_sizes(n, B, drop_remainder=stream.drop_remainder)
    spec: dict[str, Any] = {"num_examples": n, "global_batch_size": B, "drop_remainder": stream.drop_remainder,
                            "start": start, "epoch": stream._epoch, "num_replicas": stream.num_replicas}
    if stream.in_ledger:  # units are read in the stream's order: a position is a record's place in it
        spec["order"] = {"seed": 0, "shuffle": False}
    stream._passes += 1
    key = f"{stream._dispatch.name}.{stream._passes}"  # this pass's name, the same on every replica
    reader = BatchReader(lambda: stream._records(files), B)
    step = 0
    while True:
        answer = stream._dispatch(key, step, spec)
        if answer["kind"] == "stop":  # counted from `start`: a resumed epoch trained the batches before it
            stream._examples_trained = pass_examples(answer, sum(sizes[:start]), stream._epoch)
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
                work, info = stream._share(records, info, r)
            batch = stream._transform(work)
            position = JobPosition(stream._epoch, start + step)  # this replica's own count: units come in any order
            step += 1
            stream._position.batch = max(stream._position.batch, g + 1)
            yield attach_batch_info(to_device(batch, stream.device), replace(info, epoch=stream._epoch,
                                                                              position=position))
    stream._epoch += 1
    stream._position = Position.start(stream.num_virtual_shards)
