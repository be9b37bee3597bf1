"""What a yielded batch carries: ``BatchInfo`` (global size, padding, place in an update window) and its helpers.

Shared by map-style input (``towers.data``) and streams (``towers.streams``); users import these
names from ``towers.data``.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import torch

from towers._logging import get_logger
from towers.errors import InvalidArgumentError

__all__ = ["whole", "BatchInfo", "shard_bounds", "global_batch_sizes", "batch_info", "find_batch_info", "attach_batch_info",
           "host_copy", "map_tensors", "to_device", "DistributedBatches", "JobPosition", "pass_examples"]

log = get_logger(__name__)


def shard_bounds(batch_size: int, num_replicas: int, replica_id: int, unit: int = 1) -> tuple[int, int]:
    """Return ``[start, stop)`` of ``replica_id``'s contiguous share of a batch of ``batch_size`` examples.

    ``unit > 1`` cuts the batch into runs of ``unit`` examples (the last one may be shorter) and shares
    those out instead, so every share is whole runs (``bitwise=True``'s micro-batches); where ``unit x
    num_replicas`` divides the batch, the shares are the same as with ``unit=1``.

    Args:
        batch_size: the examples of the global batch.
        num_replicas: the replicas that share it.
        replica_id: the replica whose share is asked for.

    Returns:
        ``(start, stop)``: the first ``batch_size % num_replicas`` replicas get one example more.

    Example:
        ```python
        from towers.data import shard_bounds

        assert [shard_bounds(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
        ```
    """
    if unit > 1:
        lo, hi = shard_bounds(-(-batch_size // unit), num_replicas, replica_id)
        return min(lo * unit, batch_size), min(hi * unit, batch_size)
    base, extra = divmod(batch_size, num_replicas)
    start = replica_id * base + min(replica_id, extra)
    return start, start + base + (1 if replica_id < extra else 0)


def global_batch_sizes(num_examples: int, global_batch_size: int, *, drop_remainder: bool = False) -> list[int]:
    """Return the size of every global batch of one epoch.

    Args:
        num_examples: the examples of the epoch.
        global_batch_size: the examples of one global batch.
        drop_remainder: leave out a last batch smaller than ``global_batch_size``.

    Returns:
        The sizes in order: full batches, then the remainder (unless dropped).

    Example:
        ```python
        from towers.data import global_batch_sizes

        assert global_batch_sizes(10, 4) == [4, 4, 2]
        assert global_batch_sizes(10, 4, drop_remainder=True) == [4, 4]
        ```
    """
    full, rest = divmod(num_examples, global_batch_size)
    return [global_batch_size] * full + ([rest] if rest and not drop_remainder else [])


def _always() -> bool:
    return True


@dataclass(frozen=True)
class JobPosition:
    """Where a batch stands in the job: what the Trainer reads its progress from.

    A position that is not where the Trainer's own count is (a replica group that joined a running job)
    moves the Trainer there.

    Attributes:
        epoch: the epoch of the batch.
        step: the batch's place among this replica's steps of the epoch: the global batch for a static split,
            the replica's own count where batches are handed out at run time.
        committed: asked after the step that trained the batch, says whether its update was applied (always,
            except where a step can be dropped: fault tolerance retries it with the same batch, so the next
            batch has the same position).
    """

    epoch: int
    step: int
    committed: Callable[[], bool] = field(default=_always, compare=False, repr=False)


@dataclass(frozen=True)
class BatchInfo:
    """The accounting a yielded batch carries: its epoch and index, global batch size, padding and place in an update window.

    Attributes:
        index: the global batch's index in its epoch.
        num_batches: the global batches of the epoch.
        global_batch_size: the examples of the global batch, over all replicas.
        local_batch_size: this replica's share of them.
        num_padding_examples: trailing examples of the share that are padding (weight zero).
        examples_per_update: examples (global) in the optimizer update this batch belongs to.
        batches_per_update: micro-batches in that update.
        last_in_update: True on the last micro-batch of an update.
        unit: ``(pass, global batch, replica)`` of a batch handed out one at a time, else None.
        epoch: the epoch the batch belongs to.
        rows: positions ``[lo, hi)`` of the epoch's example order that this share trains, or None.
        position: the job's position at this batch.
        peer_rows: positions of the other replicas' shares of the same update that this one records as seen.
    """

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
    #: The job's position at this batch (set by every input of towers; None for a batch without one).
    position: JobPosition | None = None
    #: Positions ``[lo, hi)`` of the other replicas' shares of the same update, where this replica's commit of the
    #: update proves them trained: a replica can be lost after its share entered the update but before it recorded
    #: it (fault tolerance), so each live one records the others' shares as seen. () elsewhere.
    peer_rows: tuple[tuple[int, int], ...] = ()


#: Attribute under which a yielded tensor carries its batch's ``BatchInfo``.
_INFO_ATTR = "_towers_batch"


def batch_info(value: Any) -> BatchInfo | None:
    """Return the ``BatchInfo`` a tensor yielded by ``distribute_dataset`` carries, or None for any other value.

    Args:
        value: a tensor of a batch, or anything else.

    Returns:
        The batch's accounting, or None.

    Example:
        ```python
        import torch
        import towers
        from towers.data import batch_info

        strategy = towers.OneDeviceStrategy("cpu")
        for (x,) in strategy.distribute_dataset(torch.utils.data.TensorDataset(torch.randn(10, 2)), global_batch_size=4):
            info = batch_info(x)
            print(info.index, info.global_batch_size, info.local_batch_size)  # 0 4 4, 1 4 4, 2 2 2
        ```
    """
    return getattr(value, _INFO_ATTR, None) if isinstance(value, torch.Tensor) else None


def _leaves(value: Any) -> Iterator[Any]:
    # On every step's path (run, the Trainer): a tensor is the common leaf, and collections.abc.Mapping is checked
    # directly (typing.Mapping in isinstance goes through typing's slower __instancecheck__).
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, collections.abc.Mapping):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def find_batch_info(args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> BatchInfo | None:
    """Return the ``BatchInfo`` carried by the tensors among ``args``/``kwargs`` (nested), or None when none carries one.

    Args:
        args: a call's positional arguments (nested lists, tuples and dicts are searched).
        kwargs: its keyword arguments.

    Returns:
        The accounting of the batch the tensors come from, or None.

    Raises:
        ValueError: when tensors of batches with different accounting are mixed in one call.
    """
    found: BatchInfo | None = None
    args = args if isinstance(args, tuple) else tuple(args)
    for leaf in _leaves((args, kwargs) if kwargs else args):
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
    """Return ``value`` with ``fn`` applied to every tensor in it (tuples, namedtuples, lists and dicts keep their type).

    Args:
        value: a tensor, or tuples, namedtuples, lists and dicts of them (and of other values, kept as they are).
        fn: applied to each tensor.

    Returns:
        A new structure of the same shape (``value`` itself where it holds no tensor).
    """
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


def pass_examples(answer: Mapping[str, Any], before: int, epoch: int) -> int:
    """The examples a pass handed out at run time trained: ps task 0's count at its end, plus the ``before`` a resumed
    pass trained earlier. A count short of the epoch's is logged (a share that no live replica could train)."""
    examples, expected = int(answer["examples"]) + before, int(answer["expected"]) + before
    if examples != expected:
        log.warning("epoch %d trained on %d of its %d examples", epoch, examples, expected)
    return examples


@runtime_checkable
class DistributedBatches(Protocol):
    """What the Trainer needs from a distributed dataset: every input of towers is one.

    Iterating yields this replica's batches of the current epoch, each tensor carrying its
    ``BatchInfo`` with its ``JobPosition``, and then advances the epoch. ``batches_per_epoch`` is
    None when unknown (a stream). The Trainer counts nothing an input knows better: it takes its
    epoch and step from the batches, ``position_from`` before each epoch, and ``examples_trained``
    after it.
    """

    #: Whether the shares handed out at run time are recorded in the job's example ledger where they are handed
    #: out (parameter servers: by ps task 0); the Trainer sets it on its training input when it keeps a ledger.
    in_ledger: bool

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration covers."""

    @property
    def batches_per_epoch(self) -> int | None:
        """Global batches per epoch, or None when the input does not know before its end."""

    @property
    def examples_trained(self) -> int | None:
        """The examples the last complete iteration trained, where the input counts them (batches handed out at run
        time, a dead replica's share included), else None: the sizes of the global batches trained."""

    def position_from(self, epoch: int, step: int, *, steps_per_epoch: int | None = None) -> tuple[int, int]:
        """Return ``(epoch, step)`` of the next batch when the Trainer would go on at ``(epoch, step)``.

        The same pair for an input the Trainer positions; the job's where the input's position is
        the job's (a replica group joining a running job joins it here first, so every live replica
        gets the same answer).
        """

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


def whole(value: Any) -> Any:
    """A DTensor's whole value (``full_tensor()``, a collective over its mesh); anything else as it is."""
    return value.full_tensor() if isinstance(value, torch.Tensor) and hasattr(value, "full_tensor") else value
