"""A file shard that changes under a stream is a named error, never a short epoch (faults injected at random moments).

Files are written by each test; the reference is what plain Python reads from them. Replicas are
simulated in one process (``num_replicas``/``replica_id``); their comparison before an epoch runs on
threads, with an ``agree`` that takes the max over them as the strategies' all-reduce does.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from towers.data import Dispatch, DistributedStream, ShardChangedError, Shards, global_batch_sizes

LINES = (1500, 90, 120)  # 8 bytes a line: 12,000 bytes (more than twice the 4 KiB edges), 720, 960


def _write(folder: Path, lines: tuple[int, ...] = LINES) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate(lines):
        path = folder / f"part-{i}.txt"
        path.write_text("".join(f"{100_000 * i + j:07d}\n" for j in range(n)))
        paths.append(str(path))
    return paths


def _read_lines(path: str) -> Any:
    with open(path) as f:
        yield from f


def _parse(line: str) -> torch.Tensor:
    return torch.tensor(int(line))


def _stream(paths: list[str], **kw: Any) -> DistributedStream:
    return DistributedStream(Shards(paths, _read_lines, transform=_parse), 8, **{"seed": 3, "shuffle_block": 4, **kw})


def _plain(paths: list[str]) -> list[int]:
    """Every example, as plain Python reads the files (sorted)."""
    return sorted(int(line) for p in paths for line in open(p))


def _take(it: Any, k: int) -> list[int]:
    return [x for _ in range(k) for x in next(it).tolist()]


def test_a_shard_truncated_while_read_is_named_at_a_random_shard_and_moment(tmp_path):
    rng = random.Random(20240611)
    for attempt in range(5):
        paths = _write(tmp_path / f"attempt-{attempt}")
        it = iter(_stream(paths, seed=attempt))
        _take(it, rng.randint(1, 6))  # the files are open: the stream is between two batches
        s = rng.randrange(len(paths))
        size = os.path.getsize(paths[s])
        kept = rng.randrange(size)
        os.truncate(paths[s], kept)
        with pytest.raises(ShardChangedError, match=rf"Shard {s} \(.*part-{s}\.txt\) changed while the stream read it "
                                                    rf"in epoch 0: .*part-{s}\.txt shrank from {size} to {kept} bytes"):
            for _ in it:
                pass


@pytest.mark.parametrize("change, message", [
    ("grow", r"grew from 720 to 800 bytes"),
    ("rewrite", r"kept its size \(720 bytes\) but (its first or last 4 KiB changed|was written to)"),
])
def test_a_shard_that_grows_or_is_rewritten_while_read_is_named(tmp_path, change, message):
    paths = _write(tmp_path)
    it = iter(_stream(paths))
    _take(it, 2)
    if change == "grow":
        with open(paths[1], "a") as f:
            f.write("".join(f"{900_000 + j:07d}\n" for j in range(10)))
    else:
        Path(paths[1]).write_text("".join(f"{800_000 + j:07d}\n" for j in range(90)))
    with pytest.raises(ShardChangedError, match=rf"Shard 1 \(.*part-1\.txt\) changed while .*{message}"):
        list(it)


def test_a_write_in_the_middle_while_read_is_named_and_an_identical_replacement_is_not(tmp_path):
    paths = _write(tmp_path / "in-place")
    os.utime(paths[0], ns=(10**18, 10**18))  # an old time: the write below moves it, however coarse the clock
    it = iter(_stream(paths))
    _take(it, 2)
    with open(paths[0], "r+b") as f:  # the same size, the same first and last 4 KiB: only the time tells
        f.seek(6000)
        f.write(b"9")
    with pytest.raises(ShardChangedError, match=r"Shard 0 .*part-0\.txt kept its size \(12000 bytes\) but was "
                                                r"written to"):
        list(it)
    paths = _write(tmp_path / "replaced")
    it = iter(_stream(paths))
    got = _take(it, 2)
    shutil.copy(paths[1], paths[1] + ".tmp")  # another writer of the same data: a new file, the same bytes
    os.replace(paths[1] + ".tmp", paths[1])
    assert sorted(got + [x for b in it for x in b.tolist()]) == _plain(paths)


@pytest.mark.parametrize("change, message", [
    ("shrink", r"shrank from 960 to 480 bytes"),
    ("grow", r"grew from 960 to 1040 bytes"),
    ("new contents", r"kept its size \(960 bytes\) but its first or last 4 KiB changed"),
])
def test_a_resume_after_a_file_changed_is_named_and_the_position_keeps_the_fingerprints(tmp_path, change, message):
    paths = _write(tmp_path)
    first = _stream(paths)
    _take(iter(first), 3)
    state = first.state_dict()
    assert [[(Path(p).name, size) for p, size, _ in shard] for shard in state["files"]] == [
        [("part-0.txt", 12000)], [("part-1.txt", 720)], [("part-2.txt", 960)]]
    if change == "shrink":
        os.truncate(paths[2], 480)
    elif change == "grow":
        with open(paths[2], "a") as f:
            f.write("".join(f"{900_000 + j:07d}\n" for j in range(10)))
    else:  # the same name and size, other contents (the file was made again from another seed)
        Path(paths[2]).write_text("".join(f"{200_007 + j:07d}\n" for j in range(120)))
    resumed = _stream(paths)
    resumed.load_state_dict(state)
    with pytest.raises(ShardChangedError, match=rf"Shard 2 \(.*part-2\.txt\) changed since this stream position was "
                                                rf"saved \(24 examples into epoch 0\): .*{message}.*set_epoch"):
        next(iter(resumed))
    resumed.set_epoch(0)  # the fix it names: the epoch over, on the files as they are
    assert sorted(x for b in resumed for x in b.tolist()) == _plain(paths)


def test_an_unchanged_resume_resumes_exactly_also_when_only_the_times_moved(tmp_path):
    paths = _write(tmp_path)
    whole = [b.tolist() for b in _stream(paths)]
    assert sorted(x for b in whole for x in b) == _plain(paths)  # one epoch: every line once, none lost
    first = _stream(paths)
    it = iter(first)
    head = [next(it).tolist() for _ in range(5)]
    state = first.state_dict()
    for p in paths:  # a copy made again, or downloaded again: other times, the same bytes
        os.utime(p, ns=(1_000_000_000, 1_000_000_000))
    resumed = _stream(paths, num_replicas=2, replica_id=0)
    other = _stream(paths, num_replicas=2, replica_id=1)
    for r in (resumed, other):
        r.load_state_dict(state)
    rest = [a.tolist() + b.tolist() for a, b in zip(resumed, other)]
    assert head + rest == whole
    assert resumed.state_dict()["files"] is None and resumed.epoch == 1  # a new epoch holds no files yet


def test_streams_without_files_keep_their_behaviour(tmp_path):
    names = Shards(["a.rec", "b.rec"], lambda name: iter(range(10)))  # names, not files: nothing to fingerprint
    stream = DistributedStream(names, 4)
    it = iter(stream)
    next(it)
    assert stream.state_dict()["files"] is None and len(list(it)) == 4
    class Numbers(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    numbers = DistributedStream(Numbers(), 4, num_virtual_shards=3)
    it = iter(numbers)
    next(it)
    assert numbers.state_dict()["files"] is None and len(list(it)) == 2


class _MaxOverThreads:
    """``agree`` for replicas simulated on threads: every caller gets the element-wise max of all callers' tensors."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=30)
        self.parts: dict[int, torch.Tensor] = {}

    def __call__(self, what: str, value: torch.Tensor) -> torch.Tensor:
        self.parts[threading.get_ident()] = value
        self.barrier.wait()
        out = torch.stack(list(self.parts.values())).amax(0)
        self.barrier.wait()
        return out


def _first_batch_on_threads(streams: list[DistributedStream]) -> list[Any]:
    """Each replica's first batch or the exception it raised, each replica on its own thread (a deadline: 30 s)."""
    results: list[Any] = [None] * len(streams)

    def run(r: int) -> None:
        try:
            results[r] = next(iter(streams[r])).tolist()
        except Exception as exc:  # noqa: BLE001 (returned to the test, which asserts on it)
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a replica is still in the file check"
    return results


@pytest.mark.parametrize("change, message", [
    ("shorter", r"its size is 712 bytes on some replicas and 720 on others"),
    ("other contents", r"the same size \(720 bytes\) everywhere but different first or last 4 KiB"),
    ("missing", r"names no regular file on some replicas"),
])
def test_replicas_that_see_different_files_all_stop_with_the_named_error(tmp_path, change, message):
    copies = [_write(tmp_path / "host-0"), None]
    shutil.copytree(tmp_path / "host-0", tmp_path / "host-1")
    copies[1] = [str(tmp_path / "host-1" / Path(p).name) for p in copies[0]]
    if change == "shorter":
        os.truncate(copies[1][1], 712)
    elif change == "other contents":
        Path(copies[1][1]).write_text("".join(f"{800_000 + j:07d}\n" for j in range(90)))
    else:
        os.remove(copies[1][1])
    agree = _MaxOverThreads(2)
    streams = [_stream(copies[r], num_replicas=2, replica_id=r, agree=agree) for r in range(2)]
    results = _first_batch_on_threads(streams)
    for r, result in enumerate(results):
        assert isinstance(result, ShardChangedError), (r, result)
        assert str(result).startswith(f"[rank {r}/2] The replicas see different files for shard 1 (")
        assert "at the start of epoch 0" in str(result) and re.search(message, str(result)), str(result)
    agree_same = _MaxOverThreads(2)
    same = [_stream(copies[0], num_replicas=2, replica_id=r, agree=agree_same) for r in range(2)]
    first = _first_batch_on_threads(same)
    whole = next(iter(_stream(copies[0]))).tolist()
    assert first[0] + first[1] == whole  # the same files: the replicas' shares make one device's batch


def test_a_stream_handed_out_by_ps_task_0_is_counted_again_when_its_files_changed_between_epochs(tmp_path):
    paths = _write(tmp_path)
    specs: list[dict[str, Any]] = []

    def ask(key: str, step: int, spec: dict[str, Any]) -> dict[str, Any]:  # one worker: every unit is its own
        specs.append(spec)
        n = len(global_batch_sizes(spec["num_examples"], spec["global_batch_size"]))
        if step < n:
            return {"kind": "unit", "units": [[step, 0]]}
        return {"kind": "stop", "examples": spec["num_examples"], "expected": spec["num_examples"]}

    stream = _stream(paths, dispatch=Dispatch("d1", ask))
    assert sorted(x for b in stream for x in b.tolist()) == _plain(paths)
    with open(paths[1], "a") as f:  # between epochs: the next epoch reads the files as they are then
        f.write("".join(f"{900_000 + j:07d}\n" for j in range(10)))
    assert sorted(x for b in stream for x in b.tolist()) == _plain(paths)
    assert [s["num_examples"] for s in (specs[0], specs[-1])] == [sum(LINES), sum(LINES) + 10]
