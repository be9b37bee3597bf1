"""Loader workers (``num_workers``): the same batches, accounting and resume position as fetching in-process.

Replicas are simulated in one process (one dataset object per replica id). ``num_workers=2``
forks two DataLoader workers per iteration, so the tests keep datasets tiny and iterations few.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.data import (
    Dispatch,
    DistributedDataset,
    DistributedStream,
    Shards,
    batch_info,
    distribute_dataset,
)


class _Squares(torch.utils.data.Dataset):
    """A map-style dataset of dicts; ``pid`` says which process made the example."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"id": torch.tensor(i), "x": torch.full((2,), float(i * i)), "pid": torch.tensor(os.getpid())}


SHARDS = {"a": list(range(0, 7)), "b": list(range(100, 103)), "c": list(range(200, 209))}


def _read(name: str) -> Any:
    return iter(SHARDS[name])


def _parse(record: int) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor(record), "pid": torch.tensor(os.getpid())}


def _stream(**kw: Any) -> Shards:
    return Shards(list(SHARDS), _read, transform=_parse, **kw)


def _seen(batches: Any) -> list[tuple[list[int], Any]]:
    """(ids, BatchInfo) of each batch: what must not depend on num_workers."""
    return [(b["id"].tolist(), batch_info(b["id"])) for b in batches]


def _replicas(cls: Any, data: Any, gbs: int, n: int, **kw: Any) -> list[Any]:
    return [cls(data, gbs, num_replicas=n, replica_id=r, **kw) for r in range(n)]


def _no_children() -> bool:
    gc.collect()
    return not multiprocessing.active_children()


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_workers_give_the_same_batches_accounting_and_epochs(kind):
    # 11 examples in global batches of 5 (19 in batches of 6) over 3 replicas: the last global batch has one
    # example, so replicas 1 and 2 get an empty share there (padded with one weightless example).
    cls, data, gbs = (DistributedDataset, _Squares(), 5) if kind == "map" else (DistributedStream, _stream(), 6)
    kw: dict[str, Any] = dict(seed=5, pad_empty_batches=True, **({"shuffle_block": 2} if kind == "stream" else {}))
    inline = _replicas(cls, data, gbs, 3, **kw)
    workers = _replicas(cls, data, gbs, 3, num_workers=2, **kw)
    made_by: set[int] = set()
    for epoch, replica in ((0, 0), (0, 2), (1, 2)):  # the second epoch reshuffles the same way
        a, b = inline[replica], workers[replica]
        got = list(b)
        made_by |= {int(p) for batch in got for p in batch["pid"]}
        assert _seen(got) == _seen(a), (epoch, replica)
        assert b.epoch == a.epoch == epoch + 1
    assert batch_info(got[-1]["id"]).num_padding_examples == 1
    assert os.getpid() not in made_by  # fetched or transformed in the worker processes
    assert _no_children()


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_resume_mid_epoch_and_iter_from_match_fetching_in_process(kind):
    cls, data = (DistributedDataset, _Squares()) if kind == "map" else (DistributedStream, _stream())
    kw: dict[str, Any] = dict(seed=2, num_replicas=2, replica_id=1)
    whole = _seen(cls(data, 4, **kw))
    first = cls(data, 4, num_workers=2, prefetch_factor=3, **kw)
    it = iter(first)
    assert _seen([next(it), next(it)]) == whole[:2]  # the workers have prefetched further: not counted
    state = first.state_dict()
    assert state["batch"] == 2
    del it
    later = cls(data, 4, num_workers=2, **kw)
    later.load_state_dict(state)
    assert _seen(later) == whole[2:]
    again = cls(data, 4, num_workers=2, persistent_workers=True, **kw)  # one set of workers for both epochs
    assert _seen(again.iter_from(1)) == whole[1:]
    again.set_epoch(3)
    assert _seen(again) == _seen(_epoch(cls, data, 3, **kw))
    again.close()
    assert _no_children()


def _epoch(cls: Any, data: Any, epoch: int, **kw: Any) -> list[Any]:
    ds = cls(data, 4, **kw)
    ds.set_epoch(epoch)
    return list(ds)


def test_a_stopped_iteration_stops_its_workers_and_persistent_ones_stop_on_close():
    ds = distribute_dataset(_Squares(), 4, num_workers=2)
    for _ in ds:
        break
    assert _no_children()
    kept = distribute_dataset(_Squares(), 4, num_workers=2, persistent_workers=True, seed=1)
    pids = [{int(p) for b in kept for p in b["pid"]} for _ in range(2)]
    assert pids[0] & pids[1]  # the same worker processes served both epochs
    assert len(multiprocessing.active_children()) == 2
    # A second iteration while the first is open gets workers of its own; both give the epoch's batches.
    one, two = iter(kept), iter(kept)
    assert next(one)["id"].tolist() == next(two)["id"].tolist()
    del one, two
    kept.close()
    assert _no_children()


def test_tensor_input_under_a_strategy_carries_its_accounting_and_leaves_the_global_rng_alone():
    x, y = torch.randn(10, 3, generator=torch.Generator().manual_seed(0)), torch.arange(10) % 2
    strategy = towers.OneDeviceStrategy("cpu")
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Linear(3, 2)
    model, _ = strategy.prepare(net)

    def loss_of(a, b):
        return towers.compute_average_loss(F.cross_entropy(model(a), b, reduction="none")).detach()

    rng = torch.get_rng_state()
    losses = {w: [float(strategy.run(loss_of, args=batch)) for batch in
                  strategy.distribute_dataset((x, y), 4, seed=3, num_workers=w)] for w in (0, 2)}
    assert torch.equal(torch.get_rng_state(), rng)  # the workers' seeds come from the dataset's own generator
    assert losses[2] == losses[0] and len(losses[0]) == 3


def test_a_transform_that_raises_in_a_worker_names_the_record():
    def bad(record: int) -> Any:
        if record == 101:
            raise ValueError("corrupt")
        return torch.tensor(record)

    stream = DistributedStream(Shards(list(SHARDS), _read, transform=bad), 19, shuffle=False, num_workers=2)
    with pytest.raises(RuntimeError, match=r"transform raised on record 1 of shard 1 \(b\)"):
        list(stream)
    assert _no_children()


@pytest.mark.parametrize("options, fragment", [
    ({"num_workers": -1}, "num_workers must be an integer >= 0"),
    ({"num_workers": 1.5}, "Received: 1.5"),
    ({"num_workers": True}, "Received: True"),
    ({"prefetch_factor": 2}, "prefetch_factor needs loader workers"),
    ({"num_workers": 2, "prefetch_factor": 0}, "prefetch_factor must be a positive integer"),
    ({"persistent_workers": True}, "persistent_workers needs loader workers"),
])
def test_bad_loader_options_get_one_actionable_error(options, fragment):
    for data in (_Squares(), _stream()):
        with pytest.raises(ValueError, match="Received: .*(Pass|leave)") as caught:
            distribute_dataset(data, 4, **options)
        assert fragment in str(caught.value)
    with pytest.raises(ValueError, match="num_workers must be"):
        towers.OneDeviceStrategy("cpu").distribute_dataset(_Squares(), 4, num_workers=-2)


def test_batches_handed_out_by_ps_task_0_refuse_workers():
    dispatch = Dispatch("d1", lambda key, step, spec: {"kind": "stop", "examples": 0, "expected": 0})
    with pytest.raises(ValueError, match="num_workers=2.*num_workers=0 under ParameterServerStrategy"):
        DistributedDataset(_Squares(), 4, dispatch=dispatch, num_workers=2)
