"""Where a stream's records come from: a fixed number of virtual shards, read in one seeded order.

A source has ``num_shards`` virtual shards (V). ``open(v, start)`` yields ``(offset, record)`` of
virtual shard ``v`` from record ``start`` on, in the shard's own order. ``sequence`` turns the
V shards into an epoch's record sequence, which depends on (seed, epoch, V, shuffle_block) and
never on the number of replicas:

* shard order: a permutation of the V shards seeded by (seed, epoch) when shuffling;
* the shards interleaved round-robin (round j takes record j of every shard that has one);
* within a shard, records shuffled in blocks of ``shuffle_block`` (a seeded permutation per block).

So a shard's cursor ("records of it consumed") is enough to resume: block ``cursor // S`` is read
again and entered at ``cursor % S``, and the interleaving is rebuilt from the cursors alone.
"""

from __future__ import annotations

import hashlib
import inspect
import random
from collections import deque
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch.utils.data import IterableDataset

from towers.data._shard_files import ShardFiles, check_read, names_files, shard_files
from towers.errors import user_error

__all__ = ["Shards", "is_stream", "make_source", "sequence"]

Record = tuple[int, Any]  # (offset of the record in its virtual shard, record)


class Shards:
    """A list of files or shards: ``reader(item)`` yields the records of one shard, ``transform(record)`` makes an example.

    Args:
        items: the shards: paths, URLs, numbers... with a stable ``str`` (a checkpoint's position is tied to
            them).
        reader: ``reader(item)`` yields the records of one shard. Keep it cheap: every replica reads every
            record (the epoch's order interleaves all shards). One with a ``start`` parameter
            (``reader(item, start=n)`` yields from record ``n`` on) lets a resumed epoch seek instead of
            reading the records before its position again.
        transform: makes an example of a record; it runs only on the examples a replica keeps, so put the
            per-example cost (decoding, tokenizing) there.

    Example:
        ```python
        import towers

        shards = towers.Shards([0, 1, 2], reader=lambda shard: range(10 * shard, 10 * shard + 10),
                               transform=lambda record: record * 2)
        strategy = towers.OneDeviceStrategy("cpu")
        batches = list(strategy.distribute_dataset(shards, global_batch_size=10))
        assert sum(len(batch) for batch in batches) == 30
        ```
    """

    def __init__(self, items: Iterable[Any], reader: Callable[..., Iterable[Any]], *,
                 transform: Callable[[Any], Any] | None = None):
        self.items = list(items)
        if not self.items:
            raise user_error("Shards needs at least one file or shard", "an empty list",
                             "Pass the paths (or shard ids) to read, e.g. Shards(sorted(glob('data/*.jsonl')), reader).")
        if not callable(reader):
            raise user_error("Shards needs a reader: a function from one item to its records", type(reader).__name__,
                             "Example: Shards(paths, reader=lambda path: open(path)).", cls=TypeError)
        if transform is not None and not callable(transform):
            raise user_error("transform must be a function from a record to an example (or None)",
                             type(transform).__name__, "Example: transform=lambda line: json.loads(line).", cls=TypeError)
        self.reader, self.transform = reader, transform
        self.seekable = _takes_start(reader)

    def __len__(self) -> int:
        return len(self.items)

    def __repr__(self) -> str:
        first = ", ".join(str(i) for i in self.items[:2])
        return f"Shards({len(self.items)} shard(s): {first}{', ...' if len(self.items) > 2 else ''})"


def _takes_start(reader: Callable[..., Any]) -> bool:
    try:
        return "start" in inspect.signature(reader).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def _is_huggingface(stream: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (duck-typed, so ``datasets`` is never imported here)."""
    return (type(stream).__module__.split(".")[0] == "datasets" and hasattr(stream, "n_shards")
            and callable(getattr(stream, "shard", None)))


def is_stream(data: Any) -> bool:
    """Return True for input ``DistributedStream`` takes: ``Shards``, a torch ``IterableDataset``, a HF streaming dataset.

    Args:
        data: any input.

    Returns:
        False for a map-style dataset and anything else.
    """
    return isinstance(data, (Shards, IterableDataset)) or _is_huggingface(data)


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _ShardSource:
    """Virtual shard v is shard v of a ``Shards``."""

    def __init__(self, shards: Shards, description: str | None = None):
        self.shards = shards
        self.num_shards = len(shards)
        self.transform = shards.transform
        self.description = description or repr(shards)
        self.fingerprint = _fingerprint("shards\n" + "\n".join(str(i) for i in shards.items))
        #: Whether an entry may name a file (a path, or a tuple of paths): then epochs fingerprint the files.
        self.names_files = names_files(shards.items)

    def files(self) -> list[ShardFiles] | None:
        """Fingerprint every shard's files now (see ``towers.data._shard_files``); None when no entry may name a file."""
        return [shard_files(item) for item in self.shards.items] if self.names_files else None

    def begin_pass(self, files: list[ShardFiles] | None = None, epoch: int = 0) -> _ShardPass:
        """One reading of the shards; with ``files`` (as ``files()`` gave them), each is checked when its reader ends."""
        return _ShardPass(self, files, epoch)

    def label(self, v: int, offset: int) -> str:
        return f"record {offset} of shard {v} ({self.shards.items[v]!s})"

    def shard_name(self, v: int) -> str:
        """Shard ``v``'s entry as errors name it."""
        return str(self.shards.items[v])

    def open(self, v: int, start: int, opened: ShardFiles = (), epoch: int = 0) -> Iterator[Record]:
        """Yield ``(offset, record)`` of shard ``v`` from record ``start`` on.

        Raises:
            RuntimeError: the reader raised.
            ShardChangedError: when the reader ended, the files ``opened`` names were no longer as opened.
        """
        item, seek = self.shards.items[v], self.shards.seekable and start > 0
        offset = start if seek else 0
        try:
            records = iter(self.shards.reader(item, start=start) if seek else self.shards.reader(item))
        except Exception as exc:
            raise user_error(f"The reader raised opening shard {v} ({item!s})", f"{type(exc).__name__}: {exc}",
                             "Fix the shard or the reader; the job resumes from its last checkpoint.",
                             cls=RuntimeError) from exc
        while True:
            try:
                record = next(records)
            except StopIteration:
                if opened:  # a file truncated, grown or rewritten while read: an error, never a short epoch
                    check_read(v, item, opened, epoch)
                return
            except Exception as exc:
                raise user_error(f"The reader raised reading shard {v} ({item!s}) at record {offset} (counted from 0)",
                                 f"{type(exc).__name__}: {exc}",
                                 "Fix or remove that record or shard, or make the reader skip bad records.",
                                 cls=RuntimeError) from exc
            if offset >= start:
                yield offset, record
            offset += 1


class _ShardPass:
    """One epoch's reading of a ``_ShardSource``: each shard's files are checked when its reader ends."""

    def __init__(self, source: _ShardSource, files: list[ShardFiles] | None, epoch: int):
        self.source, self.files, self.epoch = source, files, epoch

    def label(self, v: int, offset: int) -> str:
        return self.source.label(v, offset)

    def open(self, v: int, start: int) -> Iterator[Record]:
        return self.source.open(v, start, self.files[v] if self.files is not None else (), self.epoch)


class _DealtSource:
    """One stream dealt round-robin into V virtual shards: example j goes to shard j % V as its record j // V.

    Every replica iterates the whole stream (so it must give the same examples in the same order
    each time it is iterated); each keeps and transforms only its own share.
    """

    def __init__(self, stream: Iterable[Any], num_shards: int):
        self.stream, self.num_shards, self.transform = stream, num_shards, None
        kind = f"{type(stream).__module__}.{type(stream).__qualname__}"
        size = f", {len(stream)} examples" if hasattr(stream, "__len__") else ""  # type: ignore[arg-type]
        self.description = f"{type(stream).__name__} (one stream{size}, dealt into {num_shards} virtual shards)"
        self.fingerprint = _fingerprint(f"stream\n{kind}{size}")
        self.names_files = False  # one stream: no file of its own to fingerprint

    def files(self) -> list[ShardFiles] | None:
        """None: a stream has no files towers can see."""
        return None

    def begin_pass(self, files: list[ShardFiles] | None = None, epoch: int = 0) -> _Dealer:
        return _Dealer(self)

    def label(self, v: int, offset: int) -> str:
        return f"example {offset * self.num_shards + v} of the stream {type(self.stream).__name__}"

    def shard_name(self, v: int) -> str:
        """Virtual shard ``v`` as errors name it."""
        return f"virtual shard {v} of the stream {type(self.stream).__name__}"


class _Dealer:
    """One pass over the stream, handing each virtual shard its records (queued until that shard reads them)."""

    def __init__(self, source: _DealtSource):
        self.source = source
        self.examples: Iterator[Any] | None = None
        self.next_example = 0
        self.start: list[float] = [float("inf")] * source.num_shards  # records before it are skipped
        self.queues: list[deque[Record]] = [deque() for _ in range(source.num_shards)]
        self.done = False

    def label(self, v: int, offset: int) -> str:
        return self.source.label(v, offset)

    def open(self, v: int, start: int) -> Iterator[Record]:
        self.start[v] = start
        return self._records(v)

    def _records(self, v: int) -> Iterator[Record]:
        queue = self.queues[v]
        while True:
            if queue:
                yield queue.popleft()
            elif self.done:
                return
            else:
                self._pull()

    def _pull(self) -> None:
        j, n = self.next_example, self.source.num_shards
        try:
            if self.examples is None:
                self.examples = iter(self.source.stream)
            example = next(self.examples)
        except StopIteration:
            self.done = True
            return
        except Exception as exc:
            raise user_error(f"The stream {type(self.source.stream).__name__} raised at example {j} (counted from 0)",
                             f"{type(exc).__name__}: {exc}",
                             "Fix the stream (its __iter__ or the data it reads); the job resumes from its last "
                             "checkpoint.", cls=RuntimeError) from exc
        self.next_example = j + 1
        v, offset = j % n, j // n
        if offset >= self.start[v]:
            self.queues[v].append((offset, example))


def make_source(stream: Any, num_virtual_shards: int | None) -> _ShardSource | _DealtSource:
    """Return the virtual shards of ``stream`` (see ``is_stream``).

    Raises:
        ValueError: when ``num_virtual_shards`` is given for ``Shards`` and differs from its number of shards.
        TypeError: when ``stream`` is not a stream.
    """
    if isinstance(stream, Shards) or _is_huggingface(stream):
        if _is_huggingface(stream):
            n = int(stream.n_shards)
            if n <= 1:  # one file: deal its examples into virtual shards
                return _DealtSource(stream, num_virtual_shards or 64)
            name = getattr(getattr(stream, "info", None), "dataset_name", None) or "a Hugging Face IterableDataset"
            shards = Shards(range(n), lambda i: stream.shard(num_shards=n, index=i))
            source = _ShardSource(shards, f"{name} ({n} shards)")
            source.fingerprint = _fingerprint(f"huggingface\n{name}\n{n}")
        else:
            source = _ShardSource(stream)
        if num_virtual_shards is not None and num_virtual_shards != source.num_shards:
            raise user_error(f"num_virtual_shards of a sharded input is its number of shards ({source.num_shards})",
                             num_virtual_shards, "Leave num_virtual_shards unset, or split the input into that many "
                             "shards; use shuffle_block to shuffle more finely.")
        return source
    if isinstance(stream, IterableDataset):
        return _DealtSource(stream, 64 if num_virtual_shards is None else num_virtual_shards)
    raise user_error("A stream must be towers.data.Shards, a torch IterableDataset or a Hugging Face streaming "
                     "dataset", type(stream).__name__, "Wrap files in Shards(paths, reader), or use a map-style "
                     "dataset with distribute_dataset.", cls=TypeError)


def shard_order(num_shards: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Return the order of the virtual shards in ``epoch`` (seeded by (seed, epoch), never by the replica count)."""
    order = list(range(num_shards))
    if shuffle:
        random.Random(f"towers-shards:{seed}:{epoch}").shuffle(order)
    return order


def _block_shuffled(records: Iterator[Record], cursor: int, block: int, key: str) -> Iterator[Record]:
    """Yield ``records`` (read from block ``cursor // block`` on) shuffled per block, from ``cursor`` on."""
    b, position = divmod(cursor, block)
    while True:
        chunk = list(islice(records, block))
        if not chunk:
            return
        perm = random.Random(f"{key}:{b}").sample(range(len(chunk)), len(chunk))
        for k in perm[position:]:
            yield chunk[k]
        if len(chunk) < block:
            return
        b, position = b + 1, 0


def _resume_ring(order: Sequence[int], cursors: Sequence[int]) -> list[int]:
    """The shards that may still have records, in the order round-robin visits them next (from ``cursors``).

    Round j takes record j of every shard that has one. With ``m = max(cursors)`` the round in
    progress is m - 1: the shards with cursor m were visited in it; a later shard with cursor m - 1
    is next in it; every other shard ran out (it was visited and had no record).
    """
    m = max(cursors, default=0)
    if m == 0:
        return list(order)
    last = max(i for i, v in enumerate(order) if cursors[v] == m)
    alive = [(i, v) for i, v in enumerate(order) if cursors[v] == m or (i > last and cursors[v] == m - 1)]
    split = sum(1 for i, _ in alive if i <= last)
    ring = [v for _, v in alive]
    return ring[split:] + ring[:split]


def sequence(source: Any, order: Sequence[int], cursors: Sequence[int], *, shuffle_block: int,
             key: str) -> Iterator[tuple[int, int, Any]]:
    """Yield ``(virtual shard, offset, record)`` of an epoch from the position ``cursors`` (records consumed per shard).

    ``key`` seeds the per-block permutations (None of them when ``shuffle_block`` is 1); ``order``
    is the epoch's shard order; ``source`` is a pass of ``make_source(...)`` (``begin_pass()``).
    """
    ring: deque[tuple[int, Iterator[Record]]] = deque()
    for v in _resume_ring(order, cursors):
        if shuffle_block > 1:
            start = (cursors[v] // shuffle_block) * shuffle_block
            records = _block_shuffled(source.open(v, start), cursors[v], shuffle_block, f"{key}:{v}")
        else:
            records = source.open(v, cursors[v])
        ring.append((v, records))
    while ring:
        v, records = ring.popleft()
        for offset, record in records:
            yield v, offset, record
            ring.append((v, records))
            break
