"""FullyShardedStrategy pieces in one process: the sharding policy, the mesh, the GPT, and sharded checkpoints.

Checkpoints: a save round-trips; a save that dies half-way leaves the previous checkpoint
complete and loadable under the same name (and the next save removes the debris); a
checkpoint's metadata cannot smuggle in code; the full export is one call.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.checkpoint import CheckpointError, checkpoint_info, layout, load_exported
from towers.cluster.info import ProcessInfo
from towers.models import SeedCNN
from towers.models_gpt import GPT, Block, GPTConfig, random_tokens
from towers.parallel.fsdp import DEFAULT_MIN_NUM_PARAMS, build_mesh, select_units
from towers.strategies.fully_sharded import FullyShardedStrategy


# --- policy, mesh, model ---------------------------------------------------------------------------
def test_auto_policy_shards_each_repeated_block_and_falls_back_to_size():
    gpt = GPT(GPTConfig.tiny())
    assert select_units(gpt) == list(gpt.blocks)
    assert select_units(gpt, Block) == list(gpt.blocks)
    mlp = nn.Sequential(nn.Linear(4, 300), nn.ReLU(), nn.Linear(300, 2))  # no ModuleList: the size policy
    assert select_units(mlp) == []  # nothing reaches 1M parameters: the root is the one unit
    assert select_units(mlp, 1000) == [mlp[0]]  # 1,500 parameters; the last layer (602) stays in the root
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    assert select_units(nested, nn.Linear) == [nested[0][0], nested[0][1], nested[1]]  # children first


class _Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.scaled_dot_product_attention(self.wq(x), self.wk(x), self.wv(x), is_causal=True))


class _FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False), (
            nn.Linear(dim, 2 * dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """torchtitan's Llama 3 block, in small."""

    def __init__(self, dim: int):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), _Attention(dim)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(dim), _FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class _TitanLlama(nn.Module):
    """torchtitan's Llama 3 layout: ``self.layers = nn.ModuleDict()`` of blocks keyed "0", "1", ..."""

    def __init__(self, vocab_size: int = 32, dim: int = 16, n_layers: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict()
        for layer_id in range(n_layers):
            self.layers[str(layer_id)] = TransformerBlock(dim)
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=3, n_head=2))


def _sequential_of_blocks() -> nn.Sequential:  # the embedding and the norm stay in the root
    return nn.Sequential(nn.Embedding(32, 16), TransformerBlock(16), TransformerBlock(16), nn.LayerNorm(16))


@pytest.mark.parametrize("make, blocks, logged", [
    (_TitanLlama, lambda m: list(m.layers.values()), "sharding 4 TransformerBlock units + the root"),
    (lambda: GPT(GPTConfig.tiny()), lambda m: list(m.blocks), "sharding 2 Block units + the root"),
    (_sequential_of_blocks, lambda m: [m[1], m[2]], "sharding 2 TransformerBlock units + the root"),
    (_hf_gpt2, lambda m: list(m.transformer.h), "sharding 3 GPT2Block units + the root"),
], ids=["torchtitan_module_dict", "module_list", "sequential", "hugging_face_gpt2"])
def test_auto_shards_the_repeated_blocks_wherever_the_model_keeps_them_and_says_so(make, blocks, logged, caplog):
    model = make()
    with caplog.at_level("INFO", logger="towers"):
        units = select_units(model)
    assert units == blocks(model)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("towers")] == [f"shard_units='auto': {logged}"]


@pytest.mark.parametrize("make, level, chosen", [
    (lambda: _TwoNamedBlocks(), "WARNING", "1 Linear unit of >= 1,000,000 parameters + the root"),
    # a Sequential of layers is a CNN, not a stack of blocks; below 1M parameters one unit is all any policy gives
    (lambda: SeedCNN(), "INFO", "the whole model as one unit"),
], ids=["blocks_as_attributes", "small_cnn"])
def test_auto_without_repeated_blocks_says_so_with_the_fix(make, level, chosen, caplog):
    with torch.device("meta"):
        model = make()
    with caplog.at_level("INFO", logger="towers"):
        units = select_units(model)
    assert units == select_units(model, DEFAULT_MIN_NUM_PARAMS)
    [record] = caplog.records
    size = sum(p.numel() for p in model.parameters())
    assert record.levelname == level and record.getMessage() == (
        f"shard_units='auto' found no repeated blocks in {type(model).__name__} (children of one class repeated in an "
        f"nn.ModuleList, nn.ModuleDict or nn.Sequential), so it shards its {size:,} parameters by size: {chosen}. "
        "Pass your block class (shard_units=MyBlock) or a parameter count (shard_units=10_000_000).")
    caplog.clear()
    with caplog.at_level("INFO", logger="towers"):
        select_units(model, nn.Linear)
    assert not caplog.records  # the user's own choice is not second-guessed


class _TwoNamedBlocks(nn.Module):
    """Blocks kept as attributes, not in a container: "auto" cannot tell them apart from the rest."""

    def __init__(self):
        super().__init__()
        self.block1, self.block2 = TransformerBlock(8), TransformerBlock(8)
        self.head = nn.Linear(1000, 1000)


@pytest.mark.parametrize("bad", ["blocks", 0, -5, [int], (nn.Linear, "x")])
def test_policy_rejects_bad_values_with_the_value(bad):
    with pytest.raises(ValueError, match="shard_units"):
        select_units(nn.Linear(2, 2), bad)


def test_mesh_group_must_divide_the_processes():
    with pytest.raises(ValueError, match=r"shard_group_size must divide the number of processes \(4\). Received: 3"):
        build_mesh(4, "cpu", 3)


def test_gpt_config_is_validated_and_the_model_predicts_the_next_token():
    with pytest.raises(ValueError, match="n_embd must be a multiple of n_head"):
        GPTConfig(n_embd=30, n_head=4)
    config = GPTConfig.tiny()
    model = GPT(config)
    inputs, targets = random_tokens(3, config)
    assert model(inputs).shape == (3, config.block_size, config.vocab_size)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


# --- the strategy on one process ----------------------------------------------------------------------
def _train(strategy, steps: int = 2):
    config = GPTConfig.tiny()
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = strategy.prepare(model, optimizer)
    data = random_tokens(8, config, seed=2)
    for _ in range(steps):
        for x, y in strategy.distribute_dataset(data, 4, shuffle=False):
            def step(x, y):
                per_token = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
                loss = towers.compute_average_loss(per_token.view(len(x), -1).mean(dim=1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            strategy.run(step, args=(x, y))
    return model, optimizer


def _one_process() -> FullyShardedStrategy:
    return FullyShardedStrategy(info=ProcessInfo())


def test_checkpoint_round_trip_and_full_export(tmp_path):
    strategy = _one_process()
    model, optimizer = _train(strategy)
    path = tmp_path / "ckpt"
    strategy.save_checkpoint(path, {**strategy.state_dict(model, optimizer), "epoch": 1, "note": "hello"})
    assert path.is_symlink() and layout.is_checkpoint(path)

    other = _one_process()
    fresh, fresh_optimizer = _train(other, steps=0)
    state = other.load_checkpoint(path)
    assert state["epoch"] == 1 and state["note"] == "hello" and checkpoint_info(path)["num_replicas"] == 1
    other.load_state_dict(state, fresh, fresh_optimizer)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    saved_moments = optimizer.state_dict()["state"]
    loaded_moments = fresh_optimizer.state_dict()["state"]
    assert saved_moments.keys() == loaded_moments.keys() and saved_moments
    for key in saved_moments:
        assert torch.equal(saved_moments[key]["exp_avg"], loaded_moments[key]["exp_avg"])

    exported = strategy.export_model(model, tmp_path / "model.safetensors")
    weights = load_exported(exported)
    reference = GPT(GPTConfig.tiny())
    reference.load_state_dict(weights)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    strategy = _one_process()
    model, optimizer = _train(strategy, steps=1)
    path = tmp_path / "ckpt"
    strategy.save_checkpoint(path, {**strategy.state_dict(model, optimizer), "global_step": 1})
    first_target = os.readlink(path)

    real_save = dcp.save

    def dies_after_writing(state, **kwargs):
        real_save(state, **kwargs)  # the shards and .metadata are on disk...
        raise KeyboardInterrupt("killed")  # ...but the job dies before the checkpoint is published

    monkeypatch.setattr(dcp, "save", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        strategy.save_checkpoint(path, {**strategy.state_dict(model, optimizer), "global_step": 2})
    assert os.readlink(path) == first_target  # the name still points at the complete first checkpoint
    assert towers.checkpoint.load_checkpoint(path)["global_step"] == 1
    debris = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.") and p.name != first_target]
    assert len(debris) == 1  # the torn save, invisible under the checkpoint's name

    monkeypatch.setattr(dcp, "save", real_save)
    strategy.save_checkpoint(path, {**strategy.state_dict(model, optimizer), "global_step": 3})
    assert towers.checkpoint.load_checkpoint(path)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", os.readlink(path)])  # debris removed


def test_metadata_cannot_run_code_and_foreign_paths_are_refused(tmp_path):
    strategy = _one_process()
    model, optimizer = _train(strategy, steps=0)
    path = tmp_path / "ckpt"
    strategy.save_checkpoint(path, strategy.state_dict(model, optimizer))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(Exception, match="is damaged|refusing to load"):  # the checksum sees it before any unpickling
        strategy.load_checkpoint(path)
    assert not marker.exists()

    foreign = tmp_path / "not-ours"
    foreign.mkdir()
    with pytest.raises(CheckpointError, match="not a towers checkpoint"):
        strategy.load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="that towers did not write"):
        strategy.save_checkpoint(foreign, strategy.state_dict(model, optimizer))
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        strategy.load_checkpoint(tmp_path / "missing")


def test_optimizer_that_already_stepped_is_refused():
    strategy = _one_process()
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="has not stepped yet"):
        strategy.prepare(model, optimizer)
