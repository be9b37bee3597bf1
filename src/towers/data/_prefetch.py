"""The next batch copied to a CUDA device ahead of time, on a side stream, while the current step runs.

Without it, a batch's host-to-device copy is queued on the compute stream when the step asks for the
batch: behind the previous step's kernels, and the step's own kernels wait for it. Here the copy of
batch ``n + 1`` is queued on a side stream as batch ``n`` is handed out, so it overlaps step ``n``;
the compute stream waits for that copy only (an event) when batch ``n + 1`` is handed out. The
copied tensors were allocated on the side stream: ``record_stream`` tells the caching allocator
they are in use on the compute stream, so their memory is not reused before that stream is done
with them. Nothing here waits for the device.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, TypeVar

import torch

from towers.data._batch import map_tensors, to_device

__all__ = ["copied_ahead"]

Meta = TypeVar("Meta")


def copied_ahead(items: Iterator[tuple[Any, Meta]], device: torch.device) -> Iterator[tuple[Any, Meta]]:
    """Yield ``(batch on device, meta)`` for each ``(host batch, meta)`` of ``items``, one copy ahead.

    The copies are ``to_device``'s (page-locked, non-blocking), queued on a side stream of the CUDA
    ``device``; each batch is handed out once the stream current at that moment waits for its copy.
    """
    side = torch.cuda.Stream(device)

    def launch(item: tuple[Any, Meta]) -> tuple[Any, Meta, torch.cuda.Event]:
        host, meta = item
        with torch.cuda.stream(side):
            moved = to_device(host, device)
            copied = torch.cuda.Event()
            copied.record(side)
        return moved, meta, copied

    source = iter(items)
    first = next(source, None)
    ahead = launch(first) if first is not None else None
    while ahead is not None:
        moved, meta, copied = ahead
        following = next(source, None)
        ahead = launch(following) if following is not None else None  # queued before this batch's step
        current = torch.cuda.current_stream(device)
        current.wait_event(copied)
        yield map_tensors(moved, partial(_used_on, stream=current)), meta


def _used_on(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    if tensor.device.type == "cuda":
        tensor.record_stream(stream)
    return tensor
