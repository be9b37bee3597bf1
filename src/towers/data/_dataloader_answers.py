"""What loops written for a ``torch.utils.data.DataLoader`` read from it, answered by towers' distributed input.

Training loops from pytorch/examples and Hugging Face read ``len(loader.dataset)``,
``len(loader)``, ``loader.batch_size``, ``loader.sampler.set_epoch(epoch)``, ``loader.drop_last``
and ``loader.num_workers``. ``DistributedDataset`` and ``DistributedStream`` answer them with the
meaning ``DataLoader(dataset, batch_size=B // N, sampler=DistributedSampler(dataset))`` gives on
replica ``r`` of ``N``: the user's dataset, this replica's batch size, the sampler's epoch.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

from towers.errors import user_error

__all__ = ["DataLoaderNames", "EpochSampler", "StreamWithoutLength", "stream_length_error"]


class DataLoaderNames:
    """``batch_size`` and ``drop_last`` as a ``DataLoader`` names them, for an input with ``global_batch_size``,
    ``num_replicas`` and ``drop_remainder``."""

    global_batch_size: int
    num_replicas: int
    drop_remainder: bool

    @property
    def batch_size(self) -> int:
        """This replica's batch size, ``global_batch_size // num_replicas`` (a ``DataLoader``'s under DDP)."""
        return self.global_batch_size // self.num_replicas

    @property
    def drop_last(self) -> bool:
        """``drop_remainder``, by its ``DataLoader`` name."""
        return self.drop_remainder


class _Epochs(Protocol):
    """What ``EpochSampler`` reads from the input it stands for."""

    num_replicas: int
    replica_id: int
    shuffle: bool
    seed: int
    drop_remainder: bool

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration covers."""

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration cover ``epoch`` from its first batch."""


class EpochSampler:
    """``loader.sampler``: what DDP loops read from a ``DistributedSampler``; ``set_epoch`` is the input's own.

    ``set_epoch(e)`` makes the next iteration cover epoch ``e`` from its first batch, with that
    epoch's order (``torch.randperm`` seeded with ``seed + e``, as ``DistributedSampler``), exactly
    as ``loader.set_epoch(e)``. Calling it is optional: the input also moves to the next epoch by
    itself after each complete iteration. Like ``loader.set_epoch``, it starts the epoch over, so
    after ``load_state_dict`` iterate without calling it for the epoch being resumed.
    """

    def __init__(self, data: _Epochs):
        self._data = data

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration covers."""
        return self._data.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration cover ``epoch`` from its first batch (the input's own ``set_epoch``)."""
        self._data.set_epoch(epoch)

    @property
    def num_replicas(self) -> int:
        """The number of replicas the global batches are split across."""
        return self._data.num_replicas

    @property
    def rank(self) -> int:
        """This replica's id (``DistributedSampler``'s name for it)."""
        return self._data.replica_id

    @property
    def shuffle(self) -> bool:
        """Whether each epoch has its own seeded order."""
        return self._data.shuffle

    @property
    def seed(self) -> int:
        """The seed of epoch 0's order (epoch ``e`` uses ``seed + e``)."""
        return self._data.seed

    @property
    def drop_last(self) -> bool:
        """Whether the last, partial global batch is dropped."""
        return self._data.drop_remainder

    def __repr__(self) -> str:
        return f"EpochSampler(epoch={self.epoch}, replica {self.rank}/{self.num_replicas})"


def stream_length_error(what: str, stream: Any) -> Exception:
    """Return the TypeError ``len()`` raises for a stream (or its batches) whose length is known only at its end."""
    return user_error(f"{what} has no length: a stream's number of examples is known only when it ends", stream,
                      "Count the steps or examples as they come (a step has at most loader.global_batch_size "
                      "examples over all replicas), or give distribute_dataset a map-style dataset (with __len__ "
                      "and __getitem__) where the loop needs len().", cls=TypeError)


class StreamWithoutLength:
    """``loader.dataset`` of a stream without a number of examples: the stream, except that ``len()`` says why not.

    Attributes and iteration are the stream's (``.stream`` is the object itself). ``len()``
    raises a ``TypeError`` that names the fix; the object is always true (``if loader.dataset:``).
    """

    def __init__(self, stream: Any):
        self.stream = stream

    def __getattr__(self, name: str) -> Any:
        if name == "stream":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.stream, name)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.stream)

    def __len__(self) -> int:
        raise stream_length_error(f"The stream {type(self.stream).__name__} (loader.dataset)", self.stream)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"StreamWithoutLength({self.stream!r})"
