"""A worker's input under parameter servers: a map-style dataset or a stream, its batches handed out by ps task 0."""

from __future__ import annotations

from typing import Any

import torch

from towers.data import Dispatch, DistributedDataset, DistributedStream, is_stream
from towers.errors import user_error

__all__ = ["worker_input"]


def worker_input(dataset: Any, global_batch_size: int, *, num_replicas: int, replica_id: int, device: torch.device,
                 dispatch: Dispatch | None, stream_options: dict[str, Any], split_unit: int = 1,
                 **loader_options: Any) -> DistributedDataset | DistributedStream:
    """Return this worker's ``DistributedStream`` (a stream) or ``DistributedDataset`` (anything else) of ``dataset``.

    ``split_unit``: shares are whole runs of this many examples (``bitwise=True``'s micro-batches).
    ``loader_options``: ``distribute_dataset``'s own (shuffle, seed, collate_fn, num_workers, ...).

    Raises:
        TypeError: a stream option (``stream_options``) for a map-style dataset.
    """
    common = dict(num_replicas=num_replicas, replica_id=replica_id, device=device, dispatch=dispatch,
                  split_unit=split_unit, **loader_options)
    if is_stream(dataset):
        return DistributedStream(dataset, global_batch_size, **common, **stream_options)
    if stream_options:
        raise user_error("num_virtual_shards and shuffle_block apply to streams only", sorted(stream_options),
                         "Leave them out for a map-style dataset.", cls=TypeError)
    return DistributedDataset(dataset, global_batch_size, **common)
