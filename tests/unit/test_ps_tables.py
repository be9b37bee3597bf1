"""One process: the ps wire format (JSON + tensors, never pickle), row-wise optimizers, hashing, first-touch init."""

from __future__ import annotations

import pickle

import pytest
import torch

import towers
from towers.strategies.parameter_server.requests import optimizer_name
from towers.strategies.parameter_server.tables import TableShard, TableSpec, check_options, hash_ids, initial_rows
from towers.strategies.parameter_server.wire import ProtocolError, decode, encode


def _roundtrip(value):
    raw, tensors = encode(value)
    blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else None
    return decode(raw, blob)


def test_wire_round_trips_json_values_and_tensors():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}, 1: {}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "foreach": None, "params": [0, 1]}],
             "$odd": [True, "x", float("inf")], "ids": torch.arange(5, dtype=torch.int32),
             "bf": torch.ones(2, dtype=torch.bfloat16)}
    back = _roundtrip(state)
    assert back["param_groups"] == state["param_groups"] and back["$odd"] == state["$odd"]
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"]) and back["state"][1] == {}
    assert back["ids"].dtype == torch.int32 and torch.equal(back["bf"], state["bf"])


def test_wire_refuses_objects_and_never_unpickles():
    with pytest.raises(TypeError, match="cannot travel"):
        encode({"cls": torch.optim.SGD})
    with pytest.raises(ProtocolError, match="not JSON"):
        decode(pickle.dumps({"a": 1}), None)
    with pytest.raises(ProtocolError, match="dtype"):
        decode(b'{"v": {"$t": 0}, "t": [["object", [1]]]}', torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match="more tensor bytes"):
        decode(b'{"v": {"$t": 0}, "t": [["float32", [4]]]}', torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match="marker"):
        decode(b'{"v": {"$class": "os.system"}, "t": []}', None)


class _FakeGroup:
    """Stands in for a Gloo pair: every recv fills the buffer with the next queued bytes."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def recv(self, tensors, peer, tag):
        tensors[0].copy_(self.chunks.pop(0))
        return self

    def wait(self, timeout=None):
        return True


def test_link_refuses_a_foreign_header_and_a_pickle_in_the_json_slot(tmp_path):
    from towers.strategies.parameter_server import transport

    header = torch.tensor([0x1234, transport.Op.REGISTER, 0, 8, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    link = transport.Link(_FakeGroup([header]), peer=1, name="worker 0 <-> ps 0")
    with pytest.raises(ProtocolError, match="not towers' parameter-server wire format 2"):
        link.recv(timeout_s=1)
    assert link.broken  # nothing more is read from a link that lost its framing

    planted = tmp_path / "planted"
    payload = b"cos\nsystem\n(S'touch " + str(planted).encode() + b"'\ntR."  # pickle.loads would run `touch`
    header = torch.tensor([transport.MAGIC, transport.Op.REGISTER, 0, len(payload), 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    link = transport.Link(_FakeGroup([header, torch.frombuffer(bytearray(payload), dtype=torch.uint8)]), peer=1, name="w")
    with pytest.raises(ProtocolError, match="not JSON"):
        link.recv(timeout_s=1)
    assert not planted.exists() and link.broken is None  # the whole message was read: the link stays aligned

    huge = torch.tensor([transport.MAGIC, transport.Op.PUSH, 0, 0, 0, (1 << 40) + 1, 1, 0, 0, 0, 0], dtype=torch.int64)
    link = transport.Link(_FakeGroup([huge]), peer=1, name="w")
    with pytest.raises(ProtocolError, match="flat 1099511627777 B"):  # refused before allocating anything
        link.recv(timeout_s=1)


def test_optimizer_travels_as_an_allowed_name():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_name(torch.optim.Adam(p)) == "Adam"

    class Mine(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="Received: .*Mine"):
        optimizer_name(Mine(p, lr=0.1))


@pytest.mark.parametrize("name,cls,options", [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-10, "initial_accumulator_value": 0.1}),
    ("adam", torch.optim.Adam, {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-8}),
])
def test_row_optimizer_equals_torch_when_every_row_is_touched(name, cls, options):
    spec = TableSpec("t", 10, 3, name, check_options(name, options), seed=1, scale=0.5)
    shards = [TableShard(spec, ps_index=p, num_ps=2) for p in range(2)]
    weight = torch.nn.Parameter(initial_rows(torch.arange(10), 3, seed=1, scale=0.5))
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()}
    dense = cls([weight], **kwargs)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        grad = torch.randn(10, 3, generator=g)
        weight.grad = grad.clone()
        dense.step()
        for p, shard in enumerate(shards):
            ids = torch.arange(p, 10, 2)
            shard.apply(torch.cat([ids, ids]), torch.cat([grad[ids] * 0.25, grad[ids] * 0.75]))  # duplicates summed
    for shard in shards:
        out = shard.export()
        assert torch.allclose(out["weight"], weight.detach()[out["ids"]], atol=1e-6)


def test_untouched_rows_cost_nothing_and_init_is_deterministic():
    spec = TableSpec("t", 1000, 4, "adagrad", check_options("adagrad", {}), seed=3, scale=0.1)
    shard = TableShard(spec, ps_index=1, num_ps=2)
    rows = shard.lookup(torch.tensor([1, 7, 999]))
    assert torch.equal(rows, initial_rows(torch.tensor([1, 7, 999]), 4, seed=3, scale=0.1))
    assert rows.abs().max() <= 0.1 and shard.stats()["touched"] == 3 and shard.local_rows == 500
    with pytest.raises(ValueError, match="outside ps task 1"):
        shard.lookup(torch.tensor([2]))
    saved = shard.export()
    other = TableShard(spec, ps_index=1, num_ps=2)
    other.load(saved)
    assert all(torch.equal(a, b) for a, b in zip(other.export().values(), saved.values()))


def test_hashed_ids_fall_in_range_and_spread():
    ids = torch.cat([torch.arange(-5000, 5000), torch.tensor([2**62, -(2**62)])])
    rows = hash_ids(ids, 997)
    assert int(rows.min()) >= 0 and int(rows.max()) < 997
    assert torch.equal(rows, hash_ids(ids, 997))
    assert torch.bincount(rows, minlength=997).max() < 40  # ~10 per row on average: no heavy clustering


def test_sharded_embedding_checks_and_needs_a_strategy():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        towers.ShardedEmbedding(10, 2, optimizer="rmsprop")
    with pytest.raises(ValueError, match="mode must be one of"):
        towers.ShardedEmbedding(10, 2, mode="max")
    emb = towers.ShardedEmbedding(10, 2, optimizer="adam", lr=0.01)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
        emb.row_ids(torch.tensor([[3, 10]]))
    with pytest.raises(RuntimeError, match="not connected"):
        emb(torch.tensor([[1, 2]]))
    assert emb.initial_weight().shape == (10, 2)
