"""distribute_dataset: global batches split into contiguous shares, per-epoch order, resume, empty shares, errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from towers.data import DistributedDataset, batch_info, find_batch_info, global_batch_sizes, shard_bounds


def _replica(data, gbs, n, r, **kw):
    return DistributedDataset(data, gbs, num_replicas=n, replica_id=r, **kw)


class _Dicts(Dataset):
    """A generic map-style dataset of dict samples (collated like a DataLoader)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((2,), float(i)), "y": torch.tensor(i)}


def test_shares_are_contiguous_and_differ_by_at_most_one():
    assert [shard_bounds(5, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [shard_bounds(1, 2, r) for r in range(2)] == [(0, 1), (1, 1)]
    for b in range(1, 12):
        for n in range(1, 5):
            bounds = [shard_bounds(b, n, r) for r in range(n)]
            sizes = [hi - lo for lo, hi in bounds]
            assert sum(sizes) == b and max(sizes) - min(sizes) <= 1
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))


def test_global_batch_sizes_keep_or_drop_the_remainder():
    assert global_batch_sizes(22, 8) == [8, 8, 6]
    assert global_batch_sizes(22, 8, drop_remainder=True) == [8, 8]
    assert global_batch_sizes(16, 8) == [8, 8]


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("kind", ["tensors", "tensor_dataset", "generic"])
def test_replica_shares_concatenate_to_the_one_device_batch(replicas, kind):
    x = torch.arange(22.0).unsqueeze(1)
    y = torch.arange(22)
    data = {"tensors": (x, y), "tensor_dataset": TensorDataset(x, y), "generic": _Dicts(22)}[kind]
    one = list(_replica(data, 8, 1, 0, shuffle=True, seed=3))
    shards = [list(_replica(data, 8, replicas, r, shuffle=True, seed=3)) for r in range(replicas)]
    assert len(one) == 3 and all(len(s) == 3 for s in shards)
    for i, whole in enumerate(one):
        if kind == "generic":
            joined = torch.cat([s[i]["y"] for s in shards])
            assert torch.equal(joined, whole["y"])
        else:
            joined = torch.cat([s[i][1] for s in shards])
            assert torch.equal(joined, whole[1])
    seen = torch.cat([(b["y"] if kind == "generic" else b[1]) for b in one])
    assert sorted(seen.tolist()) == list(range(22))


def test_a_single_tensor_yields_tensors_and_no_shuffle_keeps_index_order():
    batches = list(_replica(torch.arange(10), 4, 2, 1, shuffle=False))
    assert [b.tolist() for b in batches] == [[2, 3], [6, 7], [9]]


def test_order_changes_per_epoch_and_repeats_for_the_same_seed():
    ds = _replica(torch.arange(50), 10, 1, 0, seed=7)
    epoch0 = torch.cat(list(ds))
    epoch1 = torch.cat(list(ds))
    assert ds.epoch == 2 and not torch.equal(epoch0, epoch1)
    ds.set_epoch(0)
    assert torch.equal(torch.cat(list(ds)), epoch0)
    assert torch.equal(torch.cat(list(_replica(torch.arange(50), 10, 1, 0, seed=7))), epoch0)


def test_resume_mid_epoch_from_state_dict():
    ds = _replica(torch.arange(40), 8, 2, 0, seed=1)
    list(ds)  # epoch 0
    it = iter(ds)
    first_two = [next(it), next(it)]
    state = ds.state_dict()
    assert state["epoch"] == 1 and state["batch"] == 2
    rest = list(it)
    resumed = _replica(torch.arange(40), 8, 2, 0, seed=1)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(first_two) + len(again) == len(ds)
    assert all(torch.equal(a, b) for a, b in zip(again, rest))
    assert resumed.epoch == 2 and resumed.state_dict()["batch"] == 0
    ds.set_epoch(1)
    assert [b.tolist() for b in ds.iter_from(3)] == [b.tolist() for b in rest[1:]]


def test_load_state_dict_rejects_another_dataset_layout():
    ds = _replica(torch.arange(40), 8, 1, 0)
    with pytest.raises(ValueError, match="global_batch_size=16"):
        ds.load_state_dict({"epoch": 0, "batch": 1, "global_batch_size": 16})


def test_an_empty_share_is_an_empty_batch_of_the_right_structure():
    # 9 examples, global batch 8 on 2 replicas: the last batch has 1 example, replica 1 gets none.
    last = list(_replica((torch.zeros(9, 3), torch.arange(9)), 8, 2, 1))[-1]
    assert last[0].shape == (0, 3) and last[1].shape == (0,)
    generic = list(_replica(_Dicts(9), 8, 2, 1))[-1]
    assert generic["x"].shape == (0, 2) and generic["y"].shape == (0,)


def test_padding_gives_an_empty_share_one_weightless_example():
    ds = _replica(torch.arange(9), 8, 2, 1, shuffle=False, pad_empty_batches=True)
    batches = list(ds)
    assert batches[-1].tolist() == [8]
    assert [batch_info(b).num_padding_examples for b in batches] == [0, 1]  # each batch carries its own


def test_batch_info_describes_the_update_window():
    ds = _replica(torch.arange(22), 4, 2, 0, accumulation_steps=2)
    infos = [batch_info(b) for b in ds]
    assert [i.global_batch_size for i in infos] == [4, 4, 4, 4, 4, 2]
    assert [i.examples_per_update for i in infos] == [8, 8, 8, 8, 6, 6]
    assert [i.last_in_update for i in infos] == [False, True, False, True, False, True]
    ds3 = _replica(torch.arange(20), 4, 1, 0, accumulation_steps=3)
    infos = [batch_info(b) for b in ds3]
    assert [(i.examples_per_update, i.batches_per_update) for i in infos] == [(12, 3)] * 3 + [(8, 2)] * 2


def test_every_tensor_of_a_batch_carries_the_info_and_mixing_batches_is_refused():
    ds = _replica((torch.zeros(10, 2), torch.arange(10)), 4, 2, 0, shuffle=False)
    first, second, _ = list(ds)
    assert batch_info(first[0]) == batch_info(first[1]) and batch_info(first[0]).index == 0
    assert find_batch_info((first[0],), {"y": first[1]}) == batch_info(first[0])
    assert find_batch_info((torch.ones(2),)) is None and batch_info(first[0] * 2) is None
    assert find_batch_info((first[0], second[1])) == batch_info(first[0])  # same accounting: no ambiguity
    last = list(ds)[-1]
    with pytest.raises(ValueError, match="tensors of two different batches"):
        find_batch_info((first[0], last[1]))


@pytest.mark.parametrize("gbs", [0, -4, 2.5, True])
def test_global_batch_size_must_be_a_positive_integer(gbs):
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        _replica(torch.arange(10), gbs, 1, 0)


def test_global_batch_size_below_replicas_is_rejected():
    with pytest.raises(ValueError, match=r"number of replicas \(3\).*Received: 2"):
        _replica(torch.arange(10), 2, 3, 0)


def test_fewer_examples_than_replicas_is_rejected():
    with pytest.raises(ValueError, match="1 example.*fewer than the 2 replicas"):
        _replica(torch.arange(1), 2, 2, 0)


def test_drop_remainder_with_a_tiny_dataset_is_rejected():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _replica(torch.arange(5), 8, 1, 0, drop_remainder=True)


def test_streams_and_mismatched_tensors_are_rejected():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="map-style"):
        _replica(Stream(), 2, 1, 0)
    with pytest.raises(ValueError, match="same first"):
        _replica((torch.zeros(4, 2), torch.zeros(5)), 2, 1, 0)


def test_batches_arrive_on_the_replica_device():
    # "meta" stands in for an accelerator here: every tensor of every batch is moved there.
    x, y = next(iter(_replica((torch.zeros(6, 2), torch.arange(6)), 4, 2, 1, device="meta")))
    assert x.device.type == "meta" and y.device.type == "meta" and x.shape == (2, 2)


# --- what loops written for a DataLoader read (pytorch/examples, Hugging Face) -----------------------------------
def _torch_loader(dataset, gbs, n, r, *, drop_last=False, shuffle=True, seed=0):
    """The plain-torch reference: DataLoader + DistributedSampler, as a DDP script builds them on replica r of n."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=n, rank=r, shuffle=shuffle, seed=seed,
                                                  drop_last=drop_last)
    return torch.utils.data.DataLoader(dataset, batch_size=gbs // n, sampler=sampler, drop_last=drop_last)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_a_dataloader_loop_reads_what_dataloader_and_distributed_sampler_answer(n, drop):
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    for r in range(n):
        ours, ref = _replica(data, 4, n, r, drop_remainder=drop), _torch_loader(data, 4, n, r, drop_last=drop)
        assert ours.dataset is data and len(ours.dataset) == len(ref.dataset) == 10
        assert len(ours) == len(ref)
        assert ours.batch_size == ref.batch_size and ours.global_batch_size == 4
        assert (ours.drop_last, ours.num_workers) == (ref.drop_last, ref.num_workers)
        assert (ours.sampler.num_replicas, ours.sampler.rank) == (ref.sampler.num_replicas, ref.sampler.rank)
        # pytorch/examples mnist's progress line: batch_idx * len(data) of len(train_loader.dataset)
        assert [len(x) for x, _ in ours] == [len(x) for x, _ in ref]


def test_tuples_and_dicts_of_tensors_are_the_dataset_a_dataloader_would_hold():
    x, y = torch.arange(20.0).view(10, 2), torch.arange(10)
    pair = _replica((x, y), 4, 2, 0).dataset
    assert len(pair) == len(TensorDataset(x, y)) == 10
    assert all(torch.equal(a, b) for a, b in zip(pair[3], TensorDataset(x, y)[3]))
    table = _replica({"x": x, "y": y}, 4, 2, 1).dataset
    assert len(table) == 10 and torch.equal(table[3]["x"], x[3]) and torch.equal(table[3]["y"], y[3])
    assert len(_replica(y, 4, 2, 1).dataset) == 10  # a tensor is its own dataset, as DataLoader(tensor) holds it


@pytest.mark.parametrize("n", [1, 2])
def test_sampler_set_epoch_gives_the_epoch_distributed_sampler_gives(n):
    # DistributedSampler deals epoch e's order (randperm seeded seed + e) out with a stride, towers in contiguous
    # shares: the examples of each global batch (all replicas' step i) are the same.
    data = TensorDataset(torch.arange(12))
    ours = [_replica(data, 4, n, r, seed=5) for r in range(n)]
    refs = [_torch_loader(data, 4, n, r, seed=5) for r in range(n)]
    for epoch in (3, 1):
        for loader in ours + refs:
            loader.sampler.set_epoch(epoch)
        assert [o.sampler.epoch for o in ours] == [o.epoch for o in ours] == [r.sampler.epoch for r in refs]

        def steps(loaders):
            return [sorted(x for share in step for x in share[0].tolist()) for step in zip(*map(list, loaders))]

        assert steps(ours) == steps(refs)
    assert [o.epoch for o in ours] == [2] * n  # a complete iteration moves on by itself: a loop may skip set_epoch
    for ref in refs:
        ref.sampler.set_epoch(2)
    assert steps(ours) == steps(refs) != steps([_torch_loader(data, 4, n, r, seed=5) for r in range(n)])
