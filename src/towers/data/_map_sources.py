"""Where a ``DistributedDataset`` fetches its rows: tensors (fancy-indexed rows) or a map-style dataset (``dataset[i]``,
collated like a DataLoader), and the fetch a batch is made from (in the training process or a loader worker)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data import IterableDataset, TensorDataset, default_collate

from towers.data._batch import map_tensors
from towers.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["Fetch", "MapSource", "TensorDictDataset", "TensorSource", "as_user_dataset", "map_source", "run_fetch"]


class TensorSource:
    """Rows of one or more tensors with the same first dimension; batches are fancy-indexed rows (a dict with ``keys``)."""

    def __init__(self, tensors: Sequence[torch.Tensor], single: bool, keys: Sequence[str] | None = None):
        sizes = {int(t.shape[0]) if t.dim() else -1 for t in tensors}
        if len(sizes) != 1 or -1 in sizes:
            shapes = dict(zip(keys, (tuple(t.shape) for t in tensors))) if keys else [tuple(t.shape) for t in tensors]
            raise InvalidArgumentError(
                f"distribute_dataset needs tensors with the same first (example) dimension. Received shapes: {shapes}. "
                "Make every tensor hold one row per example.")
        self.tensors, self.single, self.size = tuple(tensors), single, sizes.pop()
        self.keys = tuple(keys) if keys is not None else None

    def fetch(self, index: torch.Tensor | slice | list[int]) -> Any:
        rows = tuple(t[index] for t in self.tensors)
        if self.keys is not None:
            return dict(zip(self.keys, rows))
        return rows[0] if self.single else rows


class TensorDictDataset(torch.utils.data.Dataset):
    """A dict of tensors with one row per example (``{"input_ids": ..., "labels": ...}``) as a map-style dataset of dicts."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if not tensors or bad:
            raise InvalidArgumentError(f"A dict dataset needs str keys and tensor values, one row per example. Received: "
                                       f"{bad or 'an empty dict'}. Example: {{'input_ids': ids, 'labels': labels}}.")
        self.tensors = dict(tensors)
        TensorSource(list(self.tensors.values()), single=False, keys=list(self.tensors))  # same row counts
        self._size = len(next(iter(self.tensors.values())))

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v[index] for k, v in self.tensors.items()}


class MapSource:
    """A map-style dataset: examples by ``dataset[i]`` (or ``__getitems__``), collated like a DataLoader."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]):
        self.dataset, self.collate_fn, self.size = dataset, collate_fn, len(dataset)

    def fetch(self, index: torch.Tensor | slice | list[int]) -> Any:
        if isinstance(index, slice):
            idx = list(range(index.start, index.stop))
        else:
            idx = index if isinstance(index, list) else index.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(idx) if getitems is not None else [self.dataset[i] for i in idx]
        return self.collate_fn(samples)


def as_user_dataset(dataset: Any) -> Any:
    """``dataset`` as a DataLoader's ``.dataset`` would hold it, with ``len()`` its number of examples.

    A tuple or list of tensors becomes a ``TensorDataset`` and a dict of tensors a
    ``TensorDictDataset`` (``len()`` of the tuple or dict would count tensors); anything else is itself.
    """
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return TensorDataset(*dataset)
    if isinstance(dataset, Mapping) and dataset and all(isinstance(t, torch.Tensor) for t in dataset.values()):
        return TensorDictDataset(dataset)
    return dataset


def map_source(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> TensorSource | MapSource:
    if isinstance(dataset, torch.Tensor):
        return TensorSource((dataset,), single=True)
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor) for t in dataset):
        return TensorSource(dataset, single=False)
    if isinstance(dataset, TensorDataset) and collate_fn is None:
        return TensorSource(dataset.tensors, single=False)
    if isinstance(dataset, Mapping) and dataset and all(isinstance(t, torch.Tensor) for t in dataset.values()):
        dataset = TensorDictDataset(dataset)  # {"input_ids": ..., "labels": ...}: batches are dicts
    if isinstance(dataset, TensorDictDataset) and collate_fn is None:
        return TensorSource(list(dataset.tensors.values()), single=False, keys=list(dataset.tensors))
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise InvalidTypeError(
            f"distribute_dataset needs a map-style dataset (with __len__ and __getitem__), a tensor, a tuple of "
            f"tensors or a dict of tensors. Received: {type(dataset).__name__}. Wrap your data in a torch.utils.data.Dataset or "
            "TensorDataset; for streams (IterableDataset, towers.data.Shards) use towers.data.distribute_dataset or "
            "strategy.distribute_dataset, which return a DistributedStream.")
    return MapSource(dataset, collate_fn or default_collate)


Fetch = tuple[Any, bool]  # (rows to fetch: a slice, an index tensor or list; True: keep 0 rows, the structure only)


def run_fetch(source: TensorSource | MapSource, fetch: Fetch) -> Any:
    """Return the batch ``fetch`` describes, collated on the CPU (in the training process or a loader worker)."""
    index, structure_only = fetch
    batch = source.fetch(index)
    return map_tensors(batch, lambda t: t[:0]) if structure_only else batch
