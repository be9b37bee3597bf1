"""Streams split into exact global batches: same sequence at any replica count, elastic resume, accounting, errors.

N replicas are simulated in one process: one ``DistributedStream`` per replica id, iterated in lockstep.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

import towers
from towers.cluster.info import ProcessInfo
from towers.data import (
    DistributedBatches,
    DistributedDataset,
    DistributedStream,
    InputContext,
    Shards,
    batch_info,
    distribute_dataset,
    is_stream,
)

# Five shards of different lengths (one empty): ids are globally unique.
LENGTHS = {"a.rec": 7, "b.rec": 2, "c.rec": 0, "d.rec": 11, "e.rec": 5}
FILES = {name: [100 * i + j for j in range(n)] for i, (name, n) in enumerate(LENGTHS.items())}
ALL_IDS = sorted(x for ids in FILES.values() for x in ids)


def _reader(name: str) -> Any:
    return iter(FILES[name])


def _example(record: int) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor(record), "x": torch.full((2,), float(record))}


def _shards(**kw: Any) -> Shards:
    return Shards(list(FILES), _reader, transform=_example, **kw)


class _Range(IterableDataset):
    """A re-iterable stream of ids (a torch IterableDataset, dealt into virtual shards)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def _replicas(data: Any, gbs: int, n: int, **kw: Any) -> list[DistributedStream]:
    return [DistributedStream(data, gbs, num_replicas=n, replica_id=r, **kw) for r in range(n)]


def _ids(batch: Any) -> list[int]:
    return (batch["id"] if isinstance(batch, dict) else batch).tolist()


def _global_batches(replicas: list[DistributedStream], limit: int | None = None) -> list[list[int]]:
    """Iterate the replicas in lockstep; return each global batch as the replicas' shares joined in replica order."""
    its = [iter(r) for r in replicas]
    out = []
    while limit is None or len(out) < limit:
        shares = [next(it, None) for it in its]
        if all(s is None for s in shares):
            break
        assert all(s is not None for s in shares), "replicas yielded different numbers of batches"
        out.append([x for s in shares for x in _ids(s)])
    return out


@pytest.mark.parametrize("make", [_shards, lambda: _Range(25)], ids=["shards", "iterable_dataset"])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_replica_shares_concatenate_to_the_one_device_batch(make, replicas):
    one = _global_batches(_replicas(make(), 6, 1, seed=3, shuffle_block=4))
    many = _global_batches(_replicas(make(), 6, replicas, seed=3, shuffle_block=4))
    assert many == one
    assert [len(b) for b in one] == [6, 6, 6, 6, 1]  # 25 examples: the ragged last batch is kept
    assert sorted(x for b in one for x in b) == (ALL_IDS if isinstance(make(), Shards) else list(range(25)))


def test_order_depends_on_seed_and_epoch_only_and_no_shuffle_interleaves_round_robin():
    stream = DistributedStream(_shards(), 25, seed=1)
    epoch0, epoch1 = _global_batches([stream]), _global_batches([stream])
    assert stream.epoch == 2 and epoch0 != epoch1
    stream.set_epoch(0)
    assert _global_batches([stream]) == epoch0 == _global_batches(_replicas(_shards(), 25, 1, seed=1))
    assert _global_batches(_replicas(_shards(), 25, 1, seed=2)) != epoch0
    plain = _global_batches(_replicas(_shards(), 25, 1, shuffle=False))[0]
    assert plain[:6] == [0, 100, 300, 400, 1, 101] and plain[-3:] == [308, 309, 310]
    dealt = _global_batches(_replicas(_Range(10), 4, 2, shuffle=False, num_virtual_shards=3))
    assert dealt == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_records_are_shuffled_within_blocks_of_a_shard():
    one = Shards(["s"], lambda _: iter(range(10)))
    seq = _global_batches(_replicas(one, 10, 1, shuffle_block=4))[0]
    assert sorted(seq[:4]) == [0, 1, 2, 3] and sorted(seq[4:8]) == [4, 5, 6, 7] and sorted(seq[8:]) == [8, 9]
    assert seq != list(range(10))


def _resume(data_fn, gbs_and_replicas: list[tuple[int, int, int | None]], **kw: Any) -> list[list[int]]:
    """Run stages (global batch size, replicas, batches or None for the rest), each resumed from the last's state."""
    state, batches = None, []
    for gbs, n, k in gbs_and_replicas:
        replicas = _replicas(data_fn(), gbs, n, **kw)
        for r in replicas:
            if state is not None:
                r.load_state_dict(state)
        batches += _global_batches(replicas, k)
        states = [r.state_dict() for r in replicas]
        assert all(s == states[0] for s in states)  # the position is the same on every replica
        state = states[0]
    return batches


@pytest.mark.parametrize("make", [_shards, lambda: _Range(31)], ids=["shards", "iterable_dataset"])
@pytest.mark.parametrize("stages", [[(4, 1, 2), (4, 2, 1), (4, 3, None)], [(4, 4, 3), (4, 2, None)]],
                         ids=["1-2-3", "4-2"])
def test_a_job_resumed_at_another_replica_count_trains_the_uninterrupted_epoch(make, stages):
    kw = dict(seed=11, shuffle_block=3, num_virtual_shards=None if isinstance(make(), Shards) else 8)
    whole = _global_batches(_replicas(make(), 4, 1, **kw))
    assert _resume(make, stages, **kw) == whole  # same compositions, batch by batch


def test_the_global_batch_size_may_change_on_resume():
    kw = dict(seed=5, shuffle_block=3)
    whole = [x for b in _global_batches(_replicas(_shards(), 4, 1, **kw)) for x in b]
    resumed = _resume(_shards, [(4, 2, 2), (6, 3, 1), (5, 1, None)], **kw)
    assert [len(b) for b in resumed] == [4, 4, 6, 5, 5, 1]
    assert [x for b in resumed for x in b] == whole  # the same sequence, cut differently
    assert Counter(x for b in resumed for x in b) == Counter(ALL_IDS)


def test_resuming_at_every_position_continues_the_same_sequence():
    kw = dict(seed=2, shuffle_block=2)
    whole = _global_batches(_replicas(_shards(), 3, 1, **kw))
    for k in range(len(whole) + 1):
        first = DistributedStream(_shards(), 3, **kw)
        assert _global_batches([first], k) == whole[:k]
        later = DistributedStream(_shards(), 3, **kw)
        later.load_state_dict(first.state_dict())
        assert _global_batches([later]) == whole[k:], k
        again = DistributedStream(_shards(), 3, **kw)  # no state: iter_from reads and skips k batches
        assert [_ids(b) for b in again.iter_from(k)] == whole[k:]
        assert later.epoch == again.epoch == 1


def test_a_seekable_reader_is_asked_to_start_at_the_cursors_block():
    starts = []

    def reader(name: str, start: int = 0):
        starts.append((name, start))
        return iter(FILES[name][start:])

    kw = dict(seed=4, shuffle_block=3)
    whole = _global_batches([DistributedStream(Shards(list(FILES), reader), 4, **kw)])
    first = DistributedStream(Shards(list(FILES), reader), 4, **kw)
    _global_batches([first], 3)
    starts.clear()
    later = DistributedStream(Shards(list(FILES), reader), 4, **kw)
    later.load_state_dict(first.state_dict())
    assert [x for b in _global_batches([later]) for x in b] == [x for b in whole[3:] for x in b]
    cursors = dict(zip(FILES, first.state_dict()["cursors"]))
    assert all(start == cursors[name] // 3 * 3 for name, start in starts) and any(s > 0 for _, s in starts)


def test_batch_info_matches_map_style_data_including_accumulation_windows():
    n = len(ALL_IDS)  # 25: batches 4, 4, 4, 4, 4, 4, 1
    for k in (1, 2, 3):
        for drop in (False, True):
            kw = dict(num_replicas=2, replica_id=1, accumulation_steps=k, drop_remainder=drop)
            streamed = [batch_info(b["id"]) for b in DistributedStream(_shards(), 4, **kw)]
            mapped = [batch_info(b) for b in DistributedDataset(torch.arange(n), 4, **kw)]
            keys = ("index", "global_batch_size", "local_batch_size", "examples_per_update", "batches_per_update",
                    "last_in_update")
            assert [[getattr(i, f) for f in keys] for i in streamed] == [[getattr(i, f) for f in keys] for i in mapped]
            assert [i.num_batches for i in streamed] == [0] * (len(mapped) - 1) + [len(mapped)]


def test_an_empty_share_has_the_structure_and_padding_gives_one_weightless_example():
    data = Shards(["s"], lambda _: iter(range(5)), transform=_example)
    last = [list(r)[-1] for r in _replicas(data, 4, 3, shuffle=False)]
    assert [b["id"].tolist() for b in last] == [[4], [], []] and last[2]["x"].shape == (0, 2)
    padded = list(DistributedStream(data, 4, num_replicas=3, replica_id=2, shuffle=False, pad_empty_batches=True))[-1]
    assert padded["id"].tolist() == [4] and batch_info(padded["id"]).num_padding_examples == 1


def test_the_sync_strategies_and_distribute_dataset_route_streams():
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    batches = strategy.distribute_dataset(_shards(), 8, seed=1, shuffle_block=2)
    assert isinstance(batches, DistributedStream) and batches.batches_per_epoch is None
    assert isinstance(distribute_dataset(_Range(4), 2), DistributedStream)
    assert isinstance(distribute_dataset(torch.arange(4), 2), DistributedDataset)
    assert is_stream(_shards()) and is_stream(_Range(3)) and not is_stream(torch.arange(3))
    assert isinstance(batches, DistributedBatches) and isinstance(distribute_dataset(torch.arange(4), 2),
                                                                  DistributedBatches)
    with pytest.raises(TypeError, match="streams only"):
        strategy.distribute_dataset(torch.arange(4), 2, num_virtual_shards=8)


def test_distribute_datasets_from_function_hands_the_input_context():
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    seen = strategy.distribute_datasets_from_function(lambda ctx: ctx)
    assert (seen.num_input_pipelines, seen.input_pipeline_id, seen.num_replicas_in_sync) == (1, 0, 1)
    assert seen.get_per_replica_batch_size(8) == 8
    assert InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2) \
        .get_per_replica_batch_size(8) == 4
    with pytest.raises(ValueError, match="divisible by the number of replicas .3.. Received: 10"):
        InputContext(3, 0, 3).get_per_replica_batch_size(10)
    with pytest.raises(TypeError, match="function of an InputContext"):
        strategy.distribute_datasets_from_function([1, 2])


class _FakeHuggingFace:
    """Stands in for ``datasets.IterableDataset`` (not installed here): ``n_shards`` and ``shard(num_shards, index)``."""

    def __init__(self, shards: list[list[dict[str, int]]]):
        self._shards = shards

    @property
    def n_shards(self) -> int:
        return len(self._shards)

    def shard(self, num_shards: int, index: int) -> list[dict[str, int]]:
        assert num_shards == len(self._shards)
        return self._shards[index]

    def __iter__(self):
        return (row for shard in self._shards for row in shard)


_FakeHuggingFace.__module__ = "datasets.iterable_dataset"


def test_a_hugging_face_stream_is_read_shard_by_shard():
    rows = {name: [{"id": x} for x in ids] for name, ids in FILES.items()}
    hf = _FakeHuggingFace(list(rows.values()))
    assert is_stream(hf)
    got = _global_batches(_replicas(hf, 4, 2, seed=3, shuffle_block=2))
    want = _global_batches(_replicas(Shards(list(rows), lambda n: rows[n]), 4, 1, seed=3, shuffle_block=2))
    assert got == want
    single = DistributedStream(_FakeHuggingFace([[{"id": x} for x in range(9)]]), 4, shuffle=False)
    assert single.num_virtual_shards == 64 and [_ids(b) for b in single] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


# --- what loops written for a DataLoader read (pytorch/examples, Hugging Face) -----------------------------------
class _SizedRange(_Range):
    """A stream that knows its length (``__len__``), as some torch IterableDatasets do."""

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("n", [1, 2])
def test_a_dataloader_loop_reads_what_dataloader_and_distributed_sampler_answer(n):
    examples = list(range(24))  # the same examples, map-style, for the plain-torch reference
    for r in range(n):
        ours = DistributedStream(_SizedRange(24), 8, num_replicas=n, replica_id=r, drop_remainder=True)
        sampler = DistributedSampler(examples, num_replicas=n, rank=r, drop_last=True)
        ref = DataLoader(examples, batch_size=8 // n, sampler=sampler, drop_last=True)
        assert len(ours.dataset) == len(ref.dataset) == 24 and ours.dataset.n == 24  # the stream itself
        assert ours.batch_size == ref.batch_size and ours.global_batch_size == 8
        assert (ours.drop_last, ours.num_workers) == (ref.drop_last, ref.num_workers)
        assert (ours.sampler.num_replicas, ours.sampler.rank) == (ref.sampler.num_replicas, ref.sampler.rank)
        assert [len(b) for b in ours] == [len(b) for b in ref]
    assert DistributedStream(_Range(8), 8, num_workers=2).num_workers == DataLoader(examples, num_workers=2).num_workers


@pytest.mark.parametrize("make", [_shards, lambda: _Range(25), lambda: _FakeHuggingFace([[{"id": 1}], [{"id": 2}]])],
                         ids=["shards", "iterable_dataset", "hugging_face"])
def test_len_of_a_streams_dataset_says_it_has_no_length_and_what_to_use(make):
    stream = make()
    loader = DistributedStream(stream, 4, num_replicas=2)
    with pytest.raises(TypeError, match=r"has no length: a stream's number of examples is known only when it ends.* "
                                        r"Count the steps or examples as they come.*map-style dataset"):
        len(loader.dataset)  # Shards' own len() counts its files: not the examples a progress line wants
    with pytest.raises(TypeError, match=r"DistributedStream .*has no length"):
        len(loader)
    assert loader and loader.dataset and loader.dataset.stream is stream
    if not isinstance(stream, Shards):  # a list of files: not iterable itself
        assert list(loader.dataset) == list(stream)
    if isinstance(stream, _Range):  # plain torch: a TypeError too, without the why
        with pytest.raises(TypeError):
            len(DataLoader(stream).dataset)


def test_sampler_set_epoch_is_the_streams_own_set_epoch():
    stream, same = DistributedStream(_shards(), 4, seed=2), DistributedStream(_shards(), 4, seed=2)
    stream.sampler.set_epoch(3)
    same.set_epoch(3)
    assert stream.epoch == stream.sampler.epoch == 3
    assert _global_batches([stream]) == _global_batches([same]) != _global_batches(
        [DistributedStream(_shards(), 4, seed=2)])


# --- bad input: one actionable line each ----------------------------------------------------------------
def test_a_stream_that_yields_nothing_is_named():
    with pytest.raises(ValueError, match="yielded no example in epoch 0.*not empty"):
        list(DistributedStream(Shards(["x", "y"], lambda _: iter(())), 4))

    class OneShot(IterableDataset):
        def __init__(self):
            self.it = iter(range(6))

        def __iter__(self):
            return self.it

    stream = DistributedStream(OneShot(), 4)
    assert len(list(stream)) == 2
    with pytest.raises(ValueError, match="epoch 1.*fresh iterator"):
        list(stream)


def test_fewer_examples_than_replicas_is_refused_when_found():
    with pytest.raises(ValueError, match="2 example.s., fewer than the 3 replicas.*Use more data or fewer"):
        next(iter(DistributedStream(_Range(2), 3, num_replicas=3)))


def test_a_reader_that_raises_mid_shard_names_the_shard_and_the_record():
    def reader(name: str):
        yield from FILES[name][:3]
        if name == "d.rec":
            raise OSError("truncated file")
        yield from FILES[name][3:]

    with pytest.raises(RuntimeError, match=r"shard 3 \(d.rec\) at record 3.*OSError: truncated file") as err:
        list(DistributedStream(Shards(list(FILES), reader), 4))
    assert isinstance(err.value.__cause__, OSError)

    def transform(record: int):
        if record == 402:
            raise ValueError("bad bytes")
        return record

    with pytest.raises(RuntimeError, match=r"record 2 of shard 4 \(e.rec\).*bad bytes"):
        list(DistributedStream(Shards(list(FILES), _reader, transform=transform), 4, shuffle=False))


def test_a_resume_state_from_another_input_or_seed_is_refused():
    first = DistributedStream(_shards(), 4, seed=1)
    _global_batches([first], 2)
    state = first.state_dict()
    other_files = DistributedStream(Shards(["a.rec", "d.rec"], _reader), 4, seed=1)
    with pytest.raises(ValueError, match="another input .*Resume with the same input"):
        other_files.load_state_dict(state)
    with pytest.raises(ValueError, match="another seed .seed=1.*seed=2"):
        DistributedStream(_shards(), 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="another number of virtual shards"):
        DistributedStream(_Range(30), 4, seed=1, num_virtual_shards=8).load_state_dict(
            DistributedStream(_Range(30), 4, seed=1, num_virtual_shards=16).state_dict())
    with pytest.raises(ValueError, match="one cursor per virtual shard"):
        DistributedStream(_shards(), 4, seed=1).load_state_dict({**state, "examples": 3})


@pytest.mark.parametrize("make, message", [
    (lambda: DistributedStream(_shards(), 2, num_replicas=3), "global_batch_size must be >= the number of replicas"),
    (lambda: DistributedStream(_shards(), 0), "global_batch_size must be a positive integer"),
    (lambda: Shards([], _reader), "at least one file"),
    (lambda: DistributedStream(_shards(), 4, num_virtual_shards=8), "number of shards .5.. Received: 8"),
    (lambda: DistributedStream(_shards(), 4, shuffle_block=0), "shuffle_block must be a positive integer"),
])
def test_bad_settings_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_stream_handed_out_by_ps_task_0_gives_any_replicas_share_of_any_batch():
    # Parameter servers hand out units (global batch g, replica r) at run time: a worker's own, then a dead
    # worker's (earlier batches: the stream is read again from its start). Each is that share of one device's batch.
    from towers.data import Dispatch, batch_info, shard_bounds
    from towers.data.streams import DistributedStream

    class Numbers(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    one = [b.tolist() for b in distribute_dataset(Numbers(), 4, num_virtual_shards=3, seed=1)]
    plan = [[[0, 0]], [[1, 0]], [[2, 0]], [[0, 1], [1, 1]], [[2, 1]], "empty", "stop"]
    specs = []

    def ask(key: str, step: int, spec: dict) -> dict:
        specs.append(spec)
        answer = plan[min(len(specs) - 1, len(plan) - 1)]
        if answer == "stop":
            return {"kind": "stop", "examples": 10, "expected": 10}
        return {"kind": "empty"} if answer == "empty" else {"kind": "unit", "units": answer}

    stream = DistributedStream(Numbers(), 4, num_replicas=2, replica_id=0, num_virtual_shards=3, seed=1,
                               dispatch=Dispatch("d1", ask))
    got = [(batch_info(b), b.tolist()) for b in stream]
    assert specs[0]["num_examples"] == 10 and specs[0]["num_replicas"] == 2  # counted before the pass
    units = [(info.unit[1], info.unit[2]) for info, _ in got if info.unit is not None]
    assert units == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    for (info, values), (g, r) in zip(got, units):
        lo, hi = shard_bounds(len(one[g]), 2, r)
        assert values == one[g][lo:hi] and info.global_batch_size == len(one[g]), (g, r)
    assert got[-1][1] == [] and got[-1][0].unit is None  # the empty step: no example, the same step count
    assert stream.examples_trained == 10 and stream.epoch == 1
    # Positions are this replica's own steps (units come in any order), the empty step's included.
    assert [(info.position.epoch, info.position.step) for info, _ in got] == [(0, s) for s in range(len(got))]


def test_trainer_fits_an_iterable_dataset_whose_length_it_does_not_know():
    import io

    import torch.nn.functional as F
    from torch import nn

    class Points(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(50):
                x = torch.randn(2, generator=g)
                yield x, (x.sum() > 0).long()

    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), F.cross_entropy,
                             metrics=["accuracy"], strategy=towers.OneDeviceStrategy("cpu"))
    seen = []

    class Steps(towers.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(self.params["steps"])

    out = io.StringIO()
    history = trainer.fit(Points(), epochs=3, global_batch_size=16,
                          callbacks=[Steps(), towers.callbacks.ProgressBar(stream=out)])
    assert seen == [None]  # unknown until the stream ends
    assert history.history["examples"] == [50.0, 50.0, 50.0]  # 3 batches of 16 and one of 2, every epoch
    assert history.history["accuracy"][-1] > history.history["accuracy"][0]
    with pytest.raises(TypeError, match="predict takes tensors or a map-style dataset, not a stream"):
        trainer.predict(Points())
