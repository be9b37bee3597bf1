"""``distribute_dataset``: split each global batch across replicas, reshuffle per epoch, resume mid-epoch.

Epoch ``e`` visits the examples in one order (``torch.randperm`` seeded with ``seed + e``, or
in index order without shuffling) that does not depend on the number of replicas; global batch
``i`` is examples ``[i*B, (i+1)*B)`` of that order, and replica ``r`` gets a contiguous share of
it (sizes differ by at most one, larger shares first). So N replicas see exactly the examples
one device would see in the same global batch, which is what makes the maths the same.

Under parameter servers the shares come from ps task 0 one at a time (``Dispatch``): each
replica gets its own shares first, then those of a replica that died, so no example is lost.

The last, partial global batch is kept unless ``drop_remainder=True``; a replica whose share of
it is empty gets an empty batch (every tensor with first dimension 0) and still takes part in
the step. Models that cannot take an empty batch can ask for ``pad_empty_batches=True``: that
replica then gets one copy of an example of the batch, and ``compute_average_loss`` gives it
weight zero.

**A batch carries its own accounting.** Every tensor of a yielded batch carries the batch's
``BatchInfo`` (global batch size, padding, place in an accumulation window): ``strategy.run``
reads it from the arguments it is given (``batch_info``), so fetching batches ahead, running an
evaluation pass in between, or running a kept batch again never changes what a step divides by.

Streams (``Shards``, a torch ``IterableDataset``, a Hugging Face streaming dataset) are split the
same way by ``DistributedStream`` (``towers.data.streams``); ``distribute_dataset`` picks the class.
Both are ``DistributedBatches``, the protocol the Trainer relies on.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable, Iterator, Mapping

import torch

from towers._logging import get_logger
from towers.data._batch import (
    BatchInfo,
    DistributedBatches,
    JobPosition,
    attach_batch_info,
    batch_info,
    find_batch_info,
    global_batch_sizes,
    map_tensors,
    pass_examples,
    shard_bounds,
    to_device,
)
from towers.data._dataloader_answers import DataLoaderNames, EpochSampler
from towers.data._loader import Loader, LoaderOptions
from towers.data._map_sources import Fetch
from towers.data._map_sources import TensorDictDataset as TensorDictDataset  # re-exported: towers.data.TensorDictDataset
from towers.data._map_sources import TensorSource as _TensorSource
from towers.data._map_sources import as_user_dataset as _as_user_dataset
from towers.data._map_sources import map_source as _source
from towers.data._map_sources import run_fetch as _run_fetch
from towers.data._prefetch import copied_ahead
from towers.data.streams import DistributedStream, InputContext, ShardChangedError, Shards, is_stream
from towers.errors import InvalidArgumentError, user_error
from towers.ledger.record import OrderSpec

__all__ = ["BatchInfo", "DistributedDataset", "Dispatch", "distribute_dataset", "shard_bounds", "global_batch_sizes",
           "batch_info", "find_batch_info", "map_tensors", "DistributedBatches", "JobPosition", "DistributedStream",
           "Shards", "ShardChangedError", "InputContext", "is_stream"]

log = get_logger(__name__)


class DistributedDataset(DataLoaderNames):
    """This replica's share of every global batch of ``dataset``, on its device; iterate once per epoch.

    ``len()`` is the number of global batches per epoch. The epoch counter advances after each
    complete iteration (``set_epoch`` sets it); ``state_dict()``/``load_state_dict()`` carry the
    epoch and the number of batches already consumed, so a resumed job continues at the next
    batch with the same order.

    A loop written for a ``DataLoader`` reads what it expects, as ``DataLoader(dataset,
    batch_size=B // N, sampler=DistributedSampler(dataset))`` answers on this replica:
    ``len(loader.dataset)`` (``dataset``: the user's dataset; a tuple or dict of tensors as a
    ``TensorDataset`` / ``TensorDictDataset``), ``len(loader)`` (steps per epoch),
    ``batch_size`` (``global_batch_size // num_replicas``; when B does not divide by N, the first
    ``B % N`` replicas get one example more of each full batch), ``global_batch_size``,
    ``sampler.set_epoch(e)`` (this object's ``set_epoch``), ``drop_last`` and ``num_workers``.
    ``split_unit=m`` cuts every share on a multiple of ``m`` examples (``bitwise=True``'s micro-batches:
    the strategy sets it); where ``m x num_replicas`` divides a batch, its shares are the same as without.

    ``num_workers > 0`` fetches and collates on that many ``DataLoader`` worker processes
    (``prefetch_factor``, ``persistent_workers``, ``pin_memory``: docs/streams.md, "Loader workers"); the
    batches, their order and the resume position are the same as with ``num_workers=0``. Workers
    end with the iteration (its last batch, or when the iterator is closed or dropped); persistent
    ones live until ``close()``.

    Args:
        dataset: a map-style dataset, or a tuple or dict of tensors.
        global_batch_size: the examples of one step over all replicas.
        num_replicas: the replicas that split each global batch.
        replica_id: this replica's index.
        device: where this replica's batches are put.
        shuffle: a new order every epoch (``seed + epoch``), the same on every replica.
        seed: the order's seed.
        drop_remainder: leave out a last global batch smaller than ``global_batch_size``.
        pad_empty_batches: give a replica whose share of a small last batch is empty one padding example
            (weight zero in ``compute_average_loss``), so every replica runs the step.
        accumulation_steps: micro-batches per optimizer update: the batches' accounting then says which
            update each belongs to.
        collate_fn: makes a batch of a list of examples. Default: torch's ``default_collate``.
        dispatch: hand batches out at run time (parameter servers) instead of the static split.
        num_workers: ``DataLoader`` worker processes that fetch and collate.
        prefetch_factor: batches each worker loads ahead.
        persistent_workers: keep the workers between epochs (until ``close()``).
        pin_memory: collate into page-locked memory, for a non-blocking copy. None: when the device is CUDA.
    """

    def __init__(self, dataset: Any, global_batch_size: int, *, num_replicas: int = 1, replica_id: int = 0,
                 device: torch.device | str = "cpu", shuffle: bool = True, seed: int = 0,
                 drop_remainder: bool = False, pad_empty_batches: bool = False, accumulation_steps: int = 1,
                 collate_fn: Callable[[list[Any]], Any] | None = None, dispatch: Dispatch | None = None,
                 num_workers: int = 0, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory: bool | None = None, split_unit: int = 1):
        options = LoaderOptions(num_workers=num_workers, prefetch_factor=prefetch_factor,
                                persistent_workers=persistent_workers, pin_memory=pin_memory)
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise InvalidArgumentError(
                f"global_batch_size must be a positive integer. Received: {global_batch_size!r}. "
                "It is the number of examples per step summed over all replicas, e.g. 64 * num_replicas.")
        if global_batch_size < num_replicas:
            raise InvalidArgumentError(
                f"global_batch_size must be >= the number of replicas ({num_replicas}), so that every replica "
                f"gets at least one example per full batch. Received: {global_batch_size}. "
                "Use a larger global batch or fewer replicas.")
        self._source = _source(dataset, collate_fn)
        #: The user's dataset, as ``DataLoader.dataset`` holds it: ``len(loader.dataset)`` is its number of examples.
        self.dataset = _as_user_dataset(dataset)
        n = self._source.size
        if n < num_replicas:
            raise InvalidArgumentError(
                f"The dataset has {n} example(s), fewer than the {num_replicas} replicas: some replica would never "
                "get data. Use a larger dataset or fewer replicas.")
        sizes = global_batch_sizes(n, global_batch_size, drop_remainder=drop_remainder)
        if not sizes:
            raise InvalidArgumentError(
                f"The dataset has {n} example(s), fewer than one global batch of {global_batch_size} with "
                "drop_remainder=True, so an epoch would be empty. Use a smaller global_batch_size or "
                "drop_remainder=False.")
        self.global_batch_size = global_batch_size
        self.num_examples = n
        self.num_replicas, self.replica_id = num_replicas, replica_id
        self.device = torch.device(device)
        self.shuffle, self.seed, self.drop_remainder = bool(shuffle), int(seed), bool(drop_remainder)
        self.pad_empty_batches = bool(pad_empty_batches)
        #: Shares are whole runs of this many examples (``bitwise=True``'s micro-batches; 1: any cut)
        self.split_unit = max(1, int(split_unit))
        self._sizes, self._k = sizes, max(1, int(accumulation_steps))
        self._infos = self._batch_infos(sizes, self._k)
        if dispatch is not None and self._k != 1:
            raise InvalidArgumentError("Batches handed out one at a time (parameter servers) cannot be accumulated. Received: "
                                       f"accumulation_steps={accumulation_steps}. Use accumulation_steps=1.")
        if dispatch is not None and options.num_workers:
            raise user_error("Batches handed out one at a time by ps task 0 are fetched in the training process",
                             f"num_workers={num_workers}", "Use num_workers=0 under ParameterServerStrategy, or "
                             "MirroredStrategy / HybridStrategy (static shares) for loader workers.")
        self._dispatch = dispatch
        self.num_workers = options.num_workers
        #: What DDP loops call ``sampler.set_epoch(epoch)`` on: this object's own ``set_epoch``.
        self.sampler = EpochSampler(self)
        self._loader = Loader(partial(_run_fetch, self._source), options, self.device, seed=self.seed)
        self._passes = 0  # iterations started (names a dispatched pass)
        self._examples_trained: int | None = None  # as ps task 0 counted the last complete dispatched pass
        #: Whether batches handed out at run time are recorded in the job's ledger by ps task 0 (the Trainer sets
        #: it on its training input; an evaluation pass trains nothing).
        self.in_ledger = False
        self._epoch = 0
        self._position = 0  # batches consumed in the current epoch
        self._resume_at = 0  # where the next iteration starts (load_state_dict)

    def _batch_infos(self, sizes: list[int], k: int, replica_id: int | None = None) -> list[BatchInfo]:
        infos = []
        replica_id = self.replica_id if replica_id is None else replica_id
        for i, size in enumerate(sizes):
            start, stop = shard_bounds(size, self.num_replicas, replica_id, self.split_unit)
            w0, w1 = (i // k) * k, min((i // k) * k + k, len(sizes))
            padding = 1 if stop == start and self.pad_empty_batches else 0
            infos.append(BatchInfo(i, len(sizes), size, stop - start, padding, sum(sizes[w0:w1]), w1 - w0, i == w1 - 1))
        return infos

    # --- epochs and resuming ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._infos)

    @property
    def examples_trained(self) -> int | None:
        """The examples the last complete dispatched pass trained, as ps task 0 counted them; None for a static split."""
        return self._examples_trained

    def position_from(self, epoch: int, step: int, *, steps_per_epoch: int | None = None) -> tuple[int, int]:
        """The Trainer positions this input: ``(epoch, step)`` itself."""
        return epoch, step

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (``len(self)``; a stream answers None)."""
        return len(self._infos)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration covers."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration cover ``epoch`` from its first batch."""
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0. Received: {epoch}.")
        self._epoch, self._position, self._resume_at = int(epoch), 0, 0

    def state_dict(self) -> dict[str, int]:
        """Return what a checkpoint needs to resume: epoch, batches consumed, and the settings they depend on."""
        return {"epoch": self._epoch, "batch": self._position, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_examples": self.num_examples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state``: the next iteration covers its epoch from batch ``state["batch"]`` on.

        Raises:
            ValueError: when the state belongs to a different dataset, batch size or seed.
        """
        for key in ("seed", "global_batch_size", "num_examples"):
            if key in state and int(state[key]) != getattr(self, key):
                raise InvalidArgumentError(
                    f"This checkpoint's data position was saved with {key}={state[key]}, but this dataset has "
                    f"{key}={getattr(self, key)}. Resume with the same dataset, global_batch_size and seed.")
        batch = int(state.get("batch", 0))
        if not 0 <= batch <= len(self):
            raise InvalidArgumentError(f"batch must be in [0, {len(self)}]. Received: {batch}.")
        self._epoch = int(state.get("epoch", 0))
        self._position = self._resume_at = batch

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """Return the example order of ``epoch`` (default: the current one)."""
        epoch = self._epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.num_examples)
        return torch.randperm(self.num_examples, generator=torch.Generator().manual_seed(self.seed + epoch))

    # --- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        start, self._resume_at = self._resume_at, 0
        return self.iter_from(start)

    def iter_from(self, batch: int) -> Iterator[Any]:
        """Yield this replica's batches of the current epoch from global batch ``batch`` on."""
        if not 0 <= batch <= len(self):
            raise InvalidArgumentError(f"batch must be in [0, {len(self)}]. Received: {batch}.")
        order = self.order() if self.shuffle else None
        self._position = batch
        self._passes += 1
        if self._dispatch is not None:
            yield from self._dispatched(self._dispatch, order, batch)
        else:
            to_worker = self._loader.options.num_workers > 0
            jobs = ((self._fetch(order, info, to_worker=to_worker), info) for info in self._infos[batch:])
            made = self._loader.batches(jobs, salt=self._epoch)
            if self.device.type == "cuda":  # the next batch's copy overlaps this one's step (a side stream)
                made = copied_ahead(made, self.device)
            for made_batch, info in made:
                on_device = made_batch if self.device.type == "cuda" else to_device(made_batch, self.device)
                value = attach_batch_info(on_device, replace(
                    info, epoch=self._epoch, rows=self._rows(info), position=JobPosition(self._epoch, info.index)))
                self._position = info.index + 1
                yield value
        self._epoch += 1
        self._position = 0

    def close(self) -> None:
        """Stop persistent loader workers now (otherwise they end with this object); a later epoch starts new ones."""
        self._loader.close()

    def _dispatched(self, dispatch: Dispatch, order: torch.Tensor | None, start: int) -> Iterator[Any]:
        """Yield the batches the dispatcher hands this replica: its own shares first, a dead replica's after."""
        spec: dict[str, Any] = {"num_examples": self.num_examples, "global_batch_size": self.global_batch_size,
                                "drop_remainder": self.drop_remainder, "start": start, "epoch": self._epoch,
                                "num_replicas": self.num_replicas}
        if self.in_ledger:
            spec["order"] = {"seed": self.seed, "shuffle": self.shuffle}
        infos: dict[int, list[BatchInfo]] = {self.replica_id: self._infos}
        key = f"{dispatch.name}.{self._passes}"  # this pass's name, the same on every replica
        step = 0
        while True:
            answer = dispatch(key, step, spec)
            if answer["kind"] == "stop":  # counted from `start`: a resumed epoch trained the batches before it
                self._examples_trained = pass_examples(answer, sum(self._sizes[:start]), self._epoch)
                return
            batches: list[tuple[BatchInfo, int]] = []
            if answer["kind"] == "unit":  # one or more units, each a replica's share of a global batch
                for g, r in answer["units"]:
                    if r not in infos:
                        infos[r] = self._batch_infos(self._sizes, 1, r)
                    batches.append((replace(infos[r][g], unit=(key, g, r)), r))
            else:  # an empty step: no example, the same step count as the replicas still working
                last = self._infos[-1]
                batches.append((BatchInfo(last.index, last.num_batches, last.global_batch_size, 0,
                                          1 if self.pad_empty_batches else 0, last.global_batch_size, 1, True),
                                self.replica_id))
            for info, r in batches:
                batch = _run_fetch(self._source, self._fetch(order, info, r))
                # The position is this replica's own count of its steps: units come in any order.
                value = attach_batch_info(to_device(batch, self.device), replace(
                    info, epoch=self._epoch, rows=self._rows(info, r), position=JobPosition(self._epoch, start + step)))
                step += 1
                self._position = max(self._position, info.index + 1)
                yield value

    def _rows(self, info: BatchInfo, replica_id: int | None = None) -> tuple[int, int]:
        """Positions ``[lo, hi)`` of the epoch's order that replica ``replica_id``'s share of ``info`` trains."""
        first = info.index * self.global_batch_size
        if info.local_batch_size == 0:
            return first, first
        start, stop = shard_bounds(info.global_batch_size, self.num_replicas,
                                   self.replica_id if replica_id is None else replica_id, self.split_unit)
        return first + start, first + stop

    def ledger_order(self) -> OrderSpec:
        """What fixes each epoch's example order (``order``), for the ledger."""
        return OrderSpec(self.num_examples, self.global_batch_size, self.seed, self.shuffle)

    def _fetch(self, order: torch.Tensor | None, info: BatchInfo, replica_id: int | None = None, *,
               to_worker: bool = False) -> Fetch:
        """Return which rows make this replica's share of ``info``'s global batch (``to_worker``: as a list, cheap to send)."""
        first = info.index * self.global_batch_size
        lo, hi = self._rows(info, replica_id)
        if info.num_padding_examples:  # an empty share, padded with the batch's first example
            lo, hi = first, first + 1
        structure_only = not hi > lo and not isinstance(self._source, _TensorSource)
        if structure_only:  # an empty share of a generic dataset: collate one example for the structure, keep 0 rows
            lo, hi = first, first + 1
        if order is None:
            return slice(lo, hi), structure_only
        return (order[lo:hi].tolist() if to_worker else order[lo:hi]), structure_only

    def __repr__(self) -> str:
        return (f"DistributedDataset({self.num_examples} examples, global_batch_size={self.global_batch_size}, "
                f"{len(self)} batches/epoch, replica {self.replica_id}/{self.num_replicas}, epoch={self._epoch})")


class Dispatch:
    """Where a replica gets its batches at run time: ``dispatch(key, step, spec)`` answers for step ``step``.

    The answer is ``{"kind": "unit", "units": [[global batch, whose share], ...]}`` (the batches of
    the next steps), ``{"kind": "empty"}`` (a step without examples) or ``{"kind": "stop",
    "examples": ..., "expected": ...}``.

    Args:
        name: makes the pass keys of one dataset (the same on every replica that distributes the same
            datasets in order).
        ask: ``ask(key, step, spec)`` returns the answer for step ``step`` of pass ``key`` (e.g. a request to
            parameter-server task 0).
    """

    def __init__(self, name: str, ask: Callable[[str, int, dict[str, Any]], dict[str, Any]]):
        self.name, self._ask = name, ask

    def __call__(self, key: str, step: int, spec: dict[str, Any]) -> dict[str, Any]:
        return self._ask(key, step, spec)


def distribute_dataset(dataset: Any, global_batch_size: int, **kwargs: Any) -> DistributedDataset | DistributedStream:
    """Return a ``DistributedStream`` for a stream (see ``is_stream``), else a ``DistributedDataset`` (see their parameters).

    Strategies call this with their replica layout. ``num_workers``, ``prefetch_factor``,
    ``persistent_workers`` and ``pin_memory`` (both classes) make batches on DataLoader workers.

    Args:
        dataset: a map-style dataset, a tuple or dict of tensors, or a stream.
        global_batch_size: the examples of one step over all replicas.
        **kwargs: the other arguments of ``DistributedDataset`` or ``DistributedStream``.

    Returns:
        This replica's input, iterated once per epoch.

    Example:
        ```python
        import torch
        from towers.data import distribute_dataset

        data = torch.utils.data.TensorDataset(torch.arange(12.0))
        replica_1 = distribute_dataset(data, 6, num_replicas=2, replica_id=1, shuffle=False)
        assert [x.tolist() for (x,) in replica_1] == [[3.0, 4.0, 5.0], [9.0, 10.0, 11.0]]
        ```
    """
    if is_stream(dataset):
        return DistributedStream(dataset, global_batch_size, **kwargs)
    return DistributedDataset(dataset, global_batch_size, **kwargs)
