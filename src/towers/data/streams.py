"""Streaming input split into exact global batches: files or shards, torch ``IterableDataset``, Hugging Face streams.

An epoch's examples form one sequence that depends on the seed, the epoch, the number of virtual
shards V and ``shuffle_block`` — never on the number of replicas (see ``towers.data._stream_sources``:
seeded shard order, shards interleaved round-robin, records shuffled in blocks). Global batch ``i``
is examples ``[i*B, (i+1)*B)`` of that sequence and replica ``r`` keeps its contiguous share
(``shard_bounds``), exactly as for map-style data: N replicas see in each global batch what one
device sees. Every replica reads every record (cheap: ``Shards``' reader) and transforms only the
records it keeps.

The length of a stream is unknown until it ends, so the stream reads ahead: one global batch past
the current one (to know which batch is the last) or to the end of the accumulation window (to
know how many examples the update has). ``BatchInfo.num_batches`` is 0 while unknown and
``index + 1`` on the epoch's last batch.

The position (``state_dict``) is the epoch, the examples consumed in it and one cursor per virtual
shard, all independent of the world size: a job stopped at N replicas resumes at M replicas (even
with another global batch size) and trains exactly the rest of the epoch.

File shards are fingerprinted when an iteration opens them (``towers.data._shard_files``): a file that
changes while it is read, between a save and its resume, or differs between replicas (compared
once, before the epoch's first batch, through ``agree``) is a ``ShardChangedError``, never a short
or desynchronised epoch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import default_collate

from towers._logging import get_logger
from towers.data._batch import BatchInfo, JobPosition, attach_batch_info, global_batch_sizes, shard_bounds, to_device
from towers.data._dataloader_answers import DataLoaderNames, EpochSampler, StreamWithoutLength, stream_length_error
from towers.data._input_context import InputContext
from towers.data._input_context import positive_int as _positive_int
from towers.data._loader import Loader, LoaderOptions
from towers.data._shard_files import (
    ShardChangedError,
    ShardFiles,
    agreement_vector,
    as_state,
    check_agreement,
    check_resumed,
)
from towers.data._stream_dispatch import DispatchedPass, RunTimeDispatch
from towers.data._stream_position import Position as _Position
from towers.data._stream_position import position_from_state
from towers.data._stream_reading import Transform as _Transform
from towers.data._stream_reading import Work as _Work
from towers.data._stream_sources import Shards, is_stream, make_source, sequence, shard_order
from towers.errors import InvalidArgumentError, user_error

__all__ = ["DistributedStream", "InputContext", "Shards", "ShardChangedError", "is_stream"]

log = get_logger(__name__)


class DistributedStream(DataLoaderNames):
    """This replica's share of every global batch of a stream, on its device; iterate once per epoch.

    ``stream``: ``towers.data.Shards`` (V = its number of shards), a torch ``IterableDataset``
    (one stream dealt round-robin into V = ``num_virtual_shards`` (64) virtual shards: every
    replica iterates the whole stream, so its ``__iter__`` must give the same examples in the same
    order every time, and should be cheap — each replica keeps only its share), or a Hugging Face
    ``datasets.IterableDataset`` (its ``n_shards`` shards, read with ``shard(num_shards, index)``).
    ``shuffle_block`` records of a shard are shuffled together (memory: about V x shuffle_block
    records). Batches are collated with ``collate_fn`` (``default_collate``).

    ``num_workers > 0``: the training process still reads the records and decides which this
    replica keeps (the sequence and the cursors live there), and ``DataLoader`` worker processes
    apply ``transform`` and collate (``prefetch_factor``, ``persistent_workers``, ``pin_memory``
    as for map-style data). The records a replica keeps are sent to a worker, so the reader should
    yield compact raw records (bytes, lines), with the costly decoding in ``transform``. Batches,
    their order and ``state_dict()`` are the same as with ``num_workers=0``; persistent workers
    live until ``close()``.

    File shards (``Shards`` entries that are paths, or tuples of paths) are fingerprinted when an
    iteration opens them: a file that changes while it is read, or between ``state_dict()`` and
    the resume of a mid-epoch position, raises ``ShardChangedError`` naming the shard and the change.
    ``agree(what, tensor)`` (set by the synchronous strategies) returns the element-wise max of
    ``tensor`` over the replicas, a collective every replica calls when it starts iterating: the
    replicas compare their files there, once per iteration, and all raise the same error if they
    differ. Other streams have no file to fingerprint.

    A loop written for a ``DataLoader`` reads ``batch_size`` (``global_batch_size // num_replicas``),
    ``global_batch_size``, ``sampler.set_epoch(e)`` (this object's ``set_epoch``), ``drop_last``,
    ``num_workers`` and ``dataset`` (the stream; where it has no number of examples, ``Shards``
    and Hugging Face streams among them, a view of it whose ``len()`` raises a ``TypeError`` that
    says what to use). ``len()`` of this object raises the same way until its length is known.

    Args:
        stream: ``towers.data.Shards``, a torch ``IterableDataset`` or a Hugging Face
            ``datasets.IterableDataset`` (see above).
        global_batch_size: the examples of one step over all replicas.
        num_replicas: the replicas that split each global batch.
        replica_id: this replica's index.
        device: where this replica's batches are put.
        shuffle: shuffle within blocks of ``shuffle_block`` records and the shards' order, anew every epoch.
        seed: the order's seed.
        drop_remainder: leave out a last global batch smaller than ``global_batch_size``.
        pad_empty_batches: as ``DistributedDataset``'s.
        accumulation_steps: as ``DistributedDataset``'s.
        collate_fn: makes a batch of a list of examples. Default: torch's ``default_collate``.
        num_virtual_shards: the virtual shards a torch ``IterableDataset`` is dealt into (default 64).
        shuffle_block: the records of a shard shuffled together.
        num_workers: ``DataLoader`` worker processes that transform and collate.
        prefetch_factor: as for map-style data.
        persistent_workers: as for map-style data.
        pin_memory: as for map-style data.
        dispatch: hand batches out at run time (parameter servers) instead of the static split.
        agree: the element-wise max of a tensor over the replicas (see above).
    """

    def __init__(self, stream: Any, global_batch_size: int, *, num_replicas: int = 1, replica_id: int = 0,
                 device: torch.device | str = "cpu", shuffle: bool = True, seed: int = 0,
                 drop_remainder: bool = False, pad_empty_batches: bool = False, accumulation_steps: int = 1,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_virtual_shards: int | None = None,
                 shuffle_block: int = 1024, num_workers: int = 0, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, pin_memory: bool | None = None, dispatch: Any = None,
                 agree: Callable[[str, torch.Tensor], torch.Tensor] | None = None, split_unit: int = 1):
        options = LoaderOptions(num_workers=num_workers, prefetch_factor=prefetch_factor,
                                persistent_workers=persistent_workers, pin_memory=pin_memory)
        _positive_int("global_batch_size", global_batch_size,
                      "It is the number of examples per step summed over all replicas, e.g. 64 * num_replicas.")
        if global_batch_size < num_replicas:
            raise user_error(f"global_batch_size must be >= the number of replicas ({num_replicas}), so that every "
                             "replica gets at least one example per full batch", global_batch_size,
                             "Use a larger global batch or fewer replicas.")
        if not 0 <= replica_id < num_replicas:
            raise user_error(f"replica_id must be in [0, {num_replicas})", replica_id, "Pass this replica's id.")
        if num_virtual_shards is not None:
            _positive_int("num_virtual_shards", num_virtual_shards, "Use a fixed number such as 64, the same for "
                          "every run that resumes this job.")
        self._source = make_source(stream, num_virtual_shards)
        #: The user's stream as ``DataLoader.dataset`` holds it (``len()`` only where it counts examples).
        self.dataset = stream if hasattr(stream, "__len__") and not isinstance(stream, Shards) else (
            StreamWithoutLength(stream))
        self.num_workers = options.num_workers
        #: What DDP loops call ``sampler.set_epoch(epoch)`` on: this object's own ``set_epoch``.
        self.sampler = EpochSampler(self)
        self.global_batch_size = global_batch_size
        self.num_replicas, self.replica_id = num_replicas, replica_id
        self.device = torch.device(device)
        self.shuffle, self.seed, self.drop_remainder = bool(shuffle), int(seed), bool(drop_remainder)
        self.pad_empty_batches = bool(pad_empty_batches)
        self.split_unit = max(1, int(split_unit))  # shares are whole runs of this many examples (bitwise micro-batches)
        self.shuffle_block = _positive_int("shuffle_block", shuffle_block, "Use 1 for no shuffling within shards.")
        self._k = max(1, int(accumulation_steps))
        self._collate = collate_fn or default_collate
        self._transform = _Transform(self._source, self._collate)
        self._loader = Loader(self._transform, options, self.device, seed=self.seed)
        if dispatch is not None and (self._k != 1 or num_workers):
            raise user_error("A stream handed out by ps task 0 (parameter servers) is read in the training process, "
                             "one global batch at a time", f"accumulation_steps={accumulation_steps}, "
                             f"num_workers={num_workers}", "Use accumulation_steps=1 and num_workers=0 there.")
        #: Hands out this replica's units at run time (parameter servers: ``towers.data.Dispatch``), or None.
        self._dispatch = None if dispatch is None else RunTimeDispatch(dispatch)
        self._agree = agree  # the replicas' element-wise max (None: one replica, or nobody to compare with)
        #: Whether batches handed out at run time are recorded in the job's ledger by ps task 0 (the Trainer sets
        #: it on its training input; an evaluation pass trains nothing).
        self.in_ledger = False
        self._epoch = 0
        self._position = _Position.start(self.num_virtual_shards)
        self._resume: _Position | None = None  # set by load_state_dict: where the next iteration starts

    @property
    def num_virtual_shards(self) -> int:
        """V: the number of virtual shards (fixed for the job, whatever the number of replicas)."""
        return self._source.num_shards

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration covers."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int | None:
        """None: a stream's length is known only at its end (handed out by ps task 0: once it was counted)."""
        if self._dispatch is None or self._dispatch.num_examples is None:
            return None
        return len(global_batch_sizes(self._dispatch.num_examples, self.global_batch_size,
                                      drop_remainder=self.drop_remainder))

    @property
    def examples_trained(self) -> int | None:
        """The examples the last complete dispatched pass trained, as ps task 0 counted them; None for a static split."""
        return None if self._dispatch is None else self._dispatch.examples_trained

    def position_from(self, epoch: int, step: int, *, steps_per_epoch: int | None = None) -> tuple[int, int]:
        """The Trainer positions this input: ``(epoch, step)`` itself."""
        return epoch, step

    def __len__(self) -> int:
        """``batches_per_epoch`` where it is known.

        Raises:
            TypeError: while the number of batches is unknown (the stream has not been counted).
        """
        batches = self.batches_per_epoch
        if batches is None:
            raise stream_length_error("A DistributedStream (its number of batches per epoch)", self)
        return batches

    def __bool__(self) -> bool:
        return True  # not len(): a stream without a known length is still an input

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration cover ``epoch`` from its first batch."""
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0. Received: {epoch}.")
        self._epoch, self._resume = int(epoch), None
        self._position = _Position.start(self.num_virtual_shards)

    # --- position ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Return the position to resume from: epoch, batches and examples consumed, per-virtual-shard cursors, settings."""
        p = self._position
        return {"epoch": self._epoch, "batch": p.batch, "examples": p.examples, "cursors": list(p.cursors),
                "seed": self.seed, "num_virtual_shards": self.num_virtual_shards, "shuffle": self.shuffle,
                "shuffle_block": self.shuffle_block, "fingerprint": self._source.fingerprint,
                "files": p.files if p.examples else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iteration covers its epoch from the example after the last one consumed.

        The number of replicas and the global batch size may differ from the run that saved it. Its
        file fingerprints (``"files"``) are compared when the iteration starts: a file that changed
        since then raises ``ShardChangedError`` there.

        Raises:
            ValueError: when the state was saved for another input, seed, V or shuffling, or is inconsistent.
        """
        self._epoch, position = position_from_state(state, self.state_dict(), self._source.description)
        self._position = self._resume = position

    # --- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        return self._batches(resume or _Position.start(self.num_virtual_shards), skip=0)

    def iter_from(self, batch: int) -> Iterator[Any]:
        """Yield this replica's batches of the current epoch from global batch ``batch`` on.

        From a restored position (``load_state_dict``) when ``batch`` is its batch; otherwise the
        epoch's first ``batch`` global batches are read and skipped (not transformed).
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            raise user_error("batch must be an integer >= 0", batch, "Pass the number of global batches already trained.")
        resume, self._resume = self._resume, None
        if resume is not None and resume.batch == batch:
            return self._batches(resume, skip=0)
        return self._batches(_Position.start(self.num_virtual_shards), skip=batch)

    def _batches(self, start: _Position, skip: int) -> Iterator[Any]:
        files, start = self._open_files(start)
        self._position = start.copy()
        if self._dispatch is not None:
            here = DispatchedPass(self.global_batch_size, self.drop_remainder, self.pad_empty_batches, self.num_replicas,
                                  self.device, self.in_ledger, self._epoch, self._position, lambda: self._records(files),
                                  self._check_epoch, self._share, self._transform)
            yield from self._dispatch.units(here, start.batch + skip, files)
            self._epoch += 1
            self._position = _Position.start(self.num_virtual_shards)
            return
        for cpu_batch, (info, after) in self._loader.batches(self._jobs(start, skip, files), salt=self._epoch):
            value = attach_batch_info(to_device(cpu_batch, self.device),
                                      replace(info, epoch=self._epoch, position=JobPosition(self._epoch, info.index)))
            self._position = after  # moved when a batch is yielded (not when a worker was asked for it)
            yield value
        self._epoch += 1
        self._position = _Position.start(self.num_virtual_shards)

    def _open_files(self, start: _Position) -> tuple[list[ShardFiles] | None, _Position]:
        """Fingerprint the files of the shards as this iteration opens them; return them and ``start`` with them.

        The replicas compare theirs first (one ``agree`` collective, on every replica alike), then a
        resumed position's saved fingerprints are compared: either way every replica raises alike.

        Raises:
            ShardChangedError: the replicas see different files, or a file changed since ``start`` was saved.
        """
        files = self._source.files()
        if files is None:
            return None, start
        if self._agree is not None and self.num_replicas > 1:
            # the same name on every replica (not the paths: each host may hold its copy elsewhere)
            top = self._agree(f"a stream's file check before epoch {self._epoch} ({self.num_virtual_shards} shards)",
                              agreement_vector(files))
            check_agreement(files, top, self._source.shard_name, self._epoch, rank=self.replica_id,
                            num_replicas=self.num_replicas)
        if start.files is not None and start.examples:
            check_resumed(start.files, files, self._source.shard_name, self._epoch, start.examples)
        return files, replace(start.copy(), files=as_state(files) if any(files) else None)

    def close(self) -> None:
        """Stop persistent loader workers now (otherwise they end with this object); a later epoch starts new ones."""
        self._loader.close()

    def _jobs(self, start: _Position, skip: int,
              files: list[ShardFiles] | None) -> Iterator[tuple[_Work, tuple[BatchInfo, _Position]]]:
        """Yield, per global batch from ``start`` (after skipping ``skip`` batches), what to transform and its meta.

        The meta is the batch's ``BatchInfo`` and the position after it. Runs in the training
        process (reading records is cheap; the sequence and cursors live here), ahead of the
        batches yielded when loader workers prefetch.
        """
        B = self.global_batch_size
        records = self._records(files, start.cursors)
        ahead: deque[tuple[int, int, Any]] = deque()
        pos = start.copy()
        exhausted = False

        def read_ahead(count: int) -> None:
            nonlocal exhausted
            while len(ahead) < count and not exhausted:
                record = next(records, None)
                if record is None:
                    exhausted = True
                else:
                    ahead.append(record)

        read_ahead(skip * B)
        if exhausted and skip > len(global_batch_sizes(len(ahead), B, drop_remainder=self.drop_remainder)):
            raise user_error(f"batch is past the end of epoch {self._epoch}, which has {len(ahead)} example(s) in "
                             f"global batches of {B}", skip, "Pass a batch index within the epoch (or call set_epoch).")
        for _ in range(min(skip * B, len(ahead))):
            pos.consume(ahead.popleft()[0])
        pos.batch += skip
        while True:
            i = pos.batch
            window_end = (i // self._k + 1) * self._k  # the accumulation window of batch i: [.., window_end)
            read_ahead(max((window_end - i) * B, B + (B if self.drop_remainder else 1)))
            self._check_epoch(pos.examples, len(ahead), exhausted)
            sizes = (global_batch_sizes(len(ahead), B, drop_remainder=self.drop_remainder) if exhausted
                     else [B] * (len(ahead) // B))
            if not sizes:
                break
            last = exhausted and len(sizes) == 1
            in_window = sizes[:window_end - i]
            done_in_window = i - (i // self._k) * self._k  # earlier batches of the window: full ones
            info = BatchInfo(i, i + 1 if last else 0, sizes[0], 0, 0, done_in_window * B + sum(in_window),
                             done_in_window + len(in_window), len(in_window) == 1)
            batch_records = [ahead.popleft() for _ in range(sizes[0])]
            work, info = self._share(batch_records, info)
            for v, _, _ in batch_records:
                pos.consume(v)
            pos.batch += 1
            yield work, (info, pos.copy())

    # --- the records, and a replica's share of them (also for units handed out at run time: RunTimeDispatch) ------
    def _records(self, files: list[ShardFiles] | None,
                 cursors: list[int] | None = None) -> Iterator[tuple[int, int, Any]]:
        """The epoch's records, in its sequence, from ``cursors`` (records consumed per virtual shard; default: none).

        ``files``: the shards' fingerprints as the iteration opened them, checked when each reader ends.
        """
        order = shard_order(self.num_virtual_shards, seed=self.seed, epoch=self._epoch, shuffle=self.shuffle)
        return sequence(self._source.begin_pass(files, self._epoch), order, cursors or [0] * self.num_virtual_shards,
                        shuffle_block=self.shuffle_block if self.shuffle else 1,
                        key=f"towers-block:{self.seed}:{self._epoch}")

    def _check_epoch(self, consumed: int, ahead: int, exhausted: bool) -> None:
        if not exhausted:
            return
        total = consumed + ahead
        if total == 0:
            raise user_error(f"The stream yielded no example in epoch {self._epoch}", self._source.description,
                             "Check the files or shards exist and are not empty; a torch IterableDataset must return "
                             "a fresh iterator from each __iter__ call (not a one-shot generator).")
        if total < self.num_replicas:
            raise user_error(f"Epoch {self._epoch} of the stream has {total} example(s), fewer than the "
                             f"{self.num_replicas} replicas: some replica would never get data",
                             self._source.description, "Use more data or fewer replicas.")
        if self.drop_remainder and consumed == 0 and total < self.global_batch_size:
            raise user_error(f"Epoch {self._epoch} of the stream has {total} example(s), fewer than one global batch "
                             f"of {self.global_batch_size} with drop_remainder=True, so the epoch would be empty",
                             self._source.description, "Use a smaller global_batch_size or drop_remainder=False.")

    def _share(self, records: list[tuple[int, int, Any]], info: BatchInfo,
               replica_id: int | None = None) -> tuple[_Work, BatchInfo]:
        """Return a replica's (default: this one's) share of a global batch's records (what to transform) and the
        share's ``BatchInfo``."""
        lo, hi = shard_bounds(len(records), self.num_replicas, self.replica_id if replica_id is None else replica_id,
                              self.split_unit)
        padding = 1 if hi == lo and self.pad_empty_batches else 0
        info = replace(info, local_batch_size=hi - lo, num_padding_examples=padding)
        if hi > lo:
            return (records[lo:hi], False), info
        # an empty share: the batch's first example, padded (kept) or with 0 rows (the structure only)
        return ([records[0]], not padding), info

    def __repr__(self) -> str:
        return (f"DistributedStream({self._source.description}, global_batch_size={self.global_batch_size}, "
                f"replica {self.replica_id}/{self.num_replicas}, epoch={self._epoch})")
