"""Loader workers: run the costly part of making batches on ``torch.utils.data.DataLoader`` worker processes.

``DistributedDataset`` and ``DistributedStream`` decide, in the training process, what each of
this replica's batches is made of (a *job*: example indices of a map-style dataset, or the raw
records of a stream this replica keeps) and what it means (*meta*: its ``BatchInfo`` and the
position after it). ``Loader.batches(jobs)`` turns each job into a batch:

* ``num_workers=0``: inline, in the training process (towers' behaviour before loader workers);
* ``num_workers>0``: a ``DataLoader`` whose sampler hands out the jobs in order (in the training
  process, ``prefetch_factor`` per worker ahead) and whose workers run them (``__getitem__`` of a
  dataset of jobs: fetch/transform and collate); batches come back in job order, optionally in
  pinned memory. The meta travels with the job and comes back beside the batch, so the caller
  attaches the accounting (a tensor attribute does not survive the trip between processes) and
  moves its position only when it yields the batch: a checkpoint counts what was trained, never
  what was prefetched.

Either way the same jobs give the same batches, so ``num_workers`` never changes what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from towers._logging import get_logger
from towers.cluster.strategy_options import parse_flag
from towers.errors import user_error

__all__ = ["LoaderOptions", "Loader"]

log = get_logger(__name__)

Job = tuple[Any, Any]  # (work for a worker, meta that comes back unchanged)


@dataclass(frozen=True)
class LoaderOptions:
    """How batches are made: ``num_workers`` worker processes (0: in the training process) and the DataLoader's options.

    ``prefetch_factor``: batches each worker prepares ahead (None: DataLoader's 2).
    ``persistent_workers``: keep the workers between epochs (they end with ``close()`` or the dataset).
    ``pin_memory``: collate into page-locked memory (None: when the device is CUDA), for a non-blocking copy.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool | None = None

    def __post_init__(self) -> None:
        n = self.num_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise user_error("num_workers must be an integer >= 0 (loader worker processes per replica; 0 makes "
                             "batches in the training process)", n,
                             "Pass e.g. num_workers=2, or 0 to fetch in the training process.")
        p = self.prefetch_factor
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise user_error("prefetch_factor must be a positive integer (batches each worker prepares ahead) or "
                             "None", p, "Pass e.g. prefetch_factor=2, or leave it unset.")
        if p is not None and n == 0:
            raise user_error("prefetch_factor needs loader workers", f"prefetch_factor={p} with num_workers=0",
                             "Pass num_workers > 0, or leave prefetch_factor unset.")
        object.__setattr__(self, "persistent_workers", parse_flag("persistent_workers", self.persistent_workers))
        if self.persistent_workers and n == 0:
            raise user_error("persistent_workers needs loader workers", "persistent_workers=True with num_workers=0",
                             "Pass num_workers > 0, or leave persistent_workers unset.")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise user_error("pin_memory must be True, False or None (None: when the device is CUDA)",
                             self.pin_memory, "Pass pin_memory=True or leave it unset.", cls=TypeError)


class _JobDataset(Dataset):
    """What a worker sees: ``dataset[job]`` runs the job's work and returns ``(batch, meta)``."""

    def __init__(self, run: Callable[[Any], Any]):
        self.run = run

    def __getitem__(self, job: Job) -> tuple[Any, Any]:  # type: ignore[override]
        work, meta = job
        return self.run(work), meta

    def __len__(self) -> int:  # not used: the sampler decides how many jobs there are
        return 0


class _Jobs:
    """The DataLoader's sampler: iterating it hands out the jobs of the iteration being started."""

    def __init__(self) -> None:
        self.pending: Iterator[Job] | None = None

    def __iter__(self) -> Iterator[Job]:  # DataLoader calls it twice when it starts an iteration: same iterator
        return self.pending if self.pending is not None else iter(())


def _unchanged(item: Any) -> Any:
    return item


def _shutdown(iterator: Any) -> None:
    # torch has no public call to stop an iterator's workers now; its __del__ calls the same method,
    # but only once the last reference goes, which a traceback or a cycle can delay.
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


class Loader:
    """Makes batches from jobs, inline or on DataLoader workers (see the module docstring)."""

    def __init__(self, run: Callable[[Any], Any], options: LoaderOptions, device: torch.device, *, seed: int = 0):
        self.run, self.options, self.seed = run, options, seed
        pin = options.pin_memory if options.pin_memory is not None else device.type == "cuda"
        self.pin_memory = bool(pin) and torch.cuda.is_available()
        self._persistent: tuple[DataLoader, _Jobs] | None = None
        self._persistent_busy = False

    def _make(self, persistent: bool, salt: int) -> tuple[DataLoader, _Jobs]:
        jobs = _Jobs()
        o = self.options
        # Its own generator: the workers' base seed is not drawn from (and never moves) the global RNG.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        loader = DataLoader(_JobDataset(self.run), batch_size=None, sampler=jobs, collate_fn=_unchanged,
                            num_workers=o.num_workers, prefetch_factor=o.prefetch_factor,
                            persistent_workers=persistent, pin_memory=self.pin_memory, generator=generator)
        return loader, jobs

    def batches(self, jobs: Iterator[Job], *, salt: int = 0) -> Iterator[tuple[Any, Any]]:
        """Yield ``(batch, meta)`` for each job, in order; ``salt`` (e.g. the epoch) varies the workers' seeds."""
        if self.options.num_workers == 0:
            for work, meta in jobs:
                yield self.run(work), meta
            return
        # A second iteration while the persistent workers serve another one gets workers of its own.
        persistent = self.options.persistent_workers and not self._persistent_busy
        if persistent:
            if self._persistent is None:
                self._persistent = self._make(True, salt)
            loader, sampler = self._persistent
            self._persistent_busy = True
        else:
            loader, sampler = self._make(False, salt)
        sampler.pending = jobs  # what iter(loader) hands out (DataLoader iterates its sampler anew each time)
        iterator = iter(loader)
        try:
            for batch, meta in iterator:
                yield batch, meta
        finally:
            if persistent:
                self._persistent_busy = False
            else:
                _shutdown(iterator)
                log.debug("loader workers of this iteration stopped")

    def close(self) -> None:
        """Stop the persistent workers, if any (a later iteration starts new ones)."""
        made, self._persistent = self._persistent, None
        if made is not None:
            _shutdown(getattr(made[0], "_iterator", None))
            log.debug("persistent loader workers stopped")
