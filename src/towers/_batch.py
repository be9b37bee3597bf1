"""What a yielded batch carries: ``BatchInfo`` (global size, padding, place in an update window) and its helpers.

Shared by map-style input (``towers.data``) and streams (``towers.streams``); users import these
names from ``towers.data``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from towers.errors import InvalidArgumentError

__all__ = ["BatchInfo", "shard_bounds", "global_batch_sizes", "batch_info", "find_batch_info", "attach_batch_info",
           "host_copy", "map_tensors", "to_device", "DistributedBatches", "FollowsJob"]


def shard_bounds(batch_size: int, num_replicas: int, replica_id: int) -> tuple[int, int]:
    """Return ``[start, stop)`` of ``replica_id``'s contiguous share of a batch of ``batch_size`` examples."""
    base, extra = divmod(batch_size, num_replicas)
    start = replica_id * base + min(replica_id, extra)
    return start, start + base + (1 if replica_id < extra else 0)


def global_batch_sizes(num_examples: int, global_batch_size: int, *, drop_remainder: bool = False) -> list[int]:
    """Return the size of every global batch of one epoch."""
    full, rest = divmod(num_examples, global_batch_size)
    return [global_batch_size] * full + ([rest] if rest and not drop_remainder else [])


@dataclass(frozen=True)
class BatchInfo:
    """The accounting a yielded batch carries: its epoch and index, global batch size, padding and place in an update window."""

    index: int
    num_batches: int
    global_batch_size: int
    local_batch_size: int
    num_padding_examples: int
    #: Examples (global) in the optimizer update this batch belongs to (= global_batch_size without accumulation).
    examples_per_update: int
    #: Micro-batches in that update (``gradient_accumulation_steps``, fewer at the end of an epoch).
    batches_per_update: int
    #: True on the last micro-batch of an update: gradients are all-reduced and the optimizer steps.
    last_in_update: bool
    #: ``(pass, global batch, replica)`` of a batch handed out one at a time (parameter servers), else None.
    unit: tuple[str, int, int] | None = None
    #: The epoch the batch belongs to (the input's ``epoch``, as ``set_epoch`` counts): with ``index``, the step's identity.
    epoch: int = 0
    #: Positions ``[lo, hi)`` of the epoch's example order that this share trains (empty for a padded or empty share),
    #: or None where the input does not know them (a stream): what the ledger records.
    rows: tuple[int, int] | None = None


#: Attribute under which a yielded tensor carries its batch's ``BatchInfo``.
_INFO_ATTR = "_towers_batch"


def batch_info(value: Any) -> BatchInfo | None:
    """Return the ``BatchInfo`` a tensor yielded by ``distribute_dataset`` carries, or None for any other value."""
    return getattr(value, _INFO_ATTR, None) if isinstance(value, torch.Tensor) else None


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def find_batch_info(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> BatchInfo | None:
    """Return the ``BatchInfo`` carried by the tensors among ``args``/``kwargs`` (nested), or None when none carries one.

    Raises:
        ValueError: when tensors of batches with different accounting are mixed in one call.
    """
    found: BatchInfo | None = None
    for leaf in _leaves((tuple(args), dict(kwargs or {}))):
        info = batch_info(leaf)
        if info is None or info == found:
            continue
        if found is not None and _accounting(info) != _accounting(found):
            raise InvalidArgumentError(
                f"strategy.run got tensors of two different batches: global batch {found.index} "
                f"({found.global_batch_size} examples) and global batch {info.index} ({info.global_batch_size} "
                "examples), so the step's global batch size is ambiguous. Pass the tensors of one batch from "
                "strategy.distribute_dataset, or compute the loss with "
                "towers.compute_average_loss(..., global_batch_size=N).")
        found = found or info
    return found


def _accounting(info: BatchInfo) -> tuple[int, int, int, int, bool]:
    return (info.global_batch_size, info.num_padding_examples, info.examples_per_update, info.batches_per_update,
            info.last_in_update)


def attach_batch_info(batch: Any, info: BatchInfo) -> Any:
    """Make every tensor of ``batch`` carry ``info`` (what ``strategy.run`` reads); return ``batch``."""
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor):
            setattr(leaf, _INFO_ATTR, info)
    return batch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Return ``value`` with ``fn`` applied to every tensor in it (tuples, namedtuples, lists and dicts keep their type)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    if isinstance(value, Mapping):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


_HOST_ATTR = "_towers_host"


def host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """The host tensor ``to_device`` copied ``tensor`` from (None when it made none): facts such as a label count
    read from it need no wait for the device."""
    host = getattr(tensor, _HOST_ATTR, None)
    return host if isinstance(host, torch.Tensor) else None


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device.type != "cpu":
        return tensor.to(device, non_blocking=True)
    # Page-locked host memory lets a CUDA copy overlap with compute.
    moved = (tensor.pin_memory() if device.type == "cuda" else tensor).to(device, non_blocking=True)
    setattr(moved, _HOST_ATTR, tensor)
    return moved


def to_device(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` with every tensor on ``device`` (through page-locked memory for CUDA, non-blocking).

    Each tensor copied from the host keeps its host tensor (``host_copy``).
    """
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: _moved(t, device))


@runtime_checkable
class DistributedBatches(Protocol):
    """What the Trainer needs from a distributed dataset: ``DistributedDataset`` and ``DistributedStream`` both are one.

    Iterating yields this replica's batches of the current epoch (each tensor carrying its
    ``BatchInfo``) and then advances the epoch. ``batches_per_epoch`` is None when unknown (a
    stream). ``last_pass`` is set by passes handed out at run time (parameter servers), else None.
    """

    last_pass: dict[str, int] | None

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration covers."""

    @property
    def batches_per_epoch(self) -> int | None:
        """Global batches per epoch, or None when the input does not know before its end."""

    def __iter__(self) -> Iterator[Any]:
        """Yield this replica's batches of the current epoch (from a restored position, if any)."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration cover ``epoch`` from its first batch."""

    def iter_from(self, batch: int) -> Iterator[Any]:
        """Yield this replica's batches of the current epoch from global batch ``batch`` on."""

    def state_dict(self) -> dict[str, Any]:
        """Return the position to resume from (plain Python values, for a checkpoint)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (refusing one saved for another input)."""


@runtime_checkable
class FollowsJob(Protocol):
    """An input whose position is the job's, not this replica's own count (fault-tolerant replica groups).

    A replica can join a job that is already running (a group started again heals to the live
    groups' step), and a step can fail to commit (it is retried with the same global batch): the
    Trainer then takes its epoch and step from ``job_position`` rather than counting its own steps.
    """

    def job_position(self) -> tuple[int, int]:
        """Return ``(epoch, batch)`` of the job's next step: its epoch and the global batches of it already done.

        A replica that has not joined the job yet joins it first (and catches up with it there), so
        the answer is the same on every live replica.
        """
