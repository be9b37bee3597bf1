"""The mesh and the tensor-parallel plans without processes: parsing, the numbers checked before training, the plans.

What runs on 4 processes (the maths against one device) is tests/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towers.cli import main
from towers.cluster.mesh import MeshSpec, parse_mesh
from towers.launch.spec import parse_launch_args
from towers.models_gpt import GPT, GPTConfig
from towers.parallel.tensor_parallel import check_divisible, tp_plan_for


def test_a_mesh_parses_and_fills_dp_from_the_processes():
    assert parse_mesh("dp=2,tp=2") == MeshSpec(dp=2, tp=2)
    assert parse_mesh({"tp": 4}) == MeshSpec(tp=4)
    assert parse_mesh(" tp=2 ").resolved(8) == MeshSpec(dp=4, tp=2)
    assert parse_mesh(None) is None


@pytest.mark.parametrize("value, message", [
    ("dp=2,tp", "A mesh is a list of NAME=SIZE"),
    ("dp=2,xp=2", "Unknown mesh dimension. Received: 'xp'"),
    ("pp=2,xp=2", "Unknown mesh dimension. Received: 'xp'. Use the dimensions pp, dp, tp"),
    ("tp=0", "Mesh dimension tp must be a positive integer. Received: '0'"),
    ("tp=two", "Received: 'two'"),
    ("tp=2,tp=2", "given twice"),
])
def test_a_bad_mesh_is_refused_naming_what_was_given(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_mesh(value)


def test_a_mesh_that_does_not_span_the_processes_names_both_numbers():
    with pytest.raises(ValueError, match=r"span the job's 4 process.*dp=3,tp=2 \(6 processes\)"):
        MeshSpec(dp=3, tp=2).resolved(4)
    with pytest.raises(ValueError, match=r"tp=3 \(3 processes\)"):
        MeshSpec(tp=3).resolved(4)



def test_hsdp_under_a_tp_mesh_needs_a_group_size_that_divides_dp_and_says_so_before_joining():
    from towers.cluster.info import ProcessInfo
    from towers.strategies.fully_sharded import FullyShardedStrategy

    info = ProcessInfo(rank=0, world_size=8, local_rank=0, local_world_size=8)
    with pytest.raises(ValueError, match=r"shard_group_size .* must divide dp. Received: shard_group_size=3, mesh "
                                         r"dp=4,tp=2. Use a divisor of dp=4"):
        FullyShardedStrategy(info=info, mesh="dp=4,tp=2", shard_group_size=3)


def test_towers_launch_checks_the_mesh_before_starting_a_process(tmp_path, capsys):
    spec = parse_launch_args(["--nproc-per-node", "4", "--strategy", "sharded", "--mesh", "dp=2,tp=2", "t.py"])
    assert spec.strategy_options["mesh"] == "dp=2,tp=2"
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")  # never started
    assert main(["launch", "--nproc-per-node", "4", "--strategy", "sharded", "--mesh", "dp=3,tp=2", str(script)]) == 2
    assert "dp=3,tp=2 (6 processes)" in capsys.readouterr().err
    assert main(["launch", "--nproc-per-node", "4", "--strategy", "sharded", "--mesh", "dp=2,tp=2",
                 "--strategy-option", "mesh=tp=4", str(script)]) == 2
    assert "The mesh is given twice" in capsys.readouterr().err
    assert main(["launch", "--nproc-per-node", "4", "--strategy", "ps", "--mesh", "dp=2,tp=2", str(script)]) == 2
    assert "does not take the option 'mesh'" in capsys.readouterr().err


def test_towers_k8s_passes_the_mesh_on(tmp_path):
    target = tmp_path / "job.yaml"
    assert main(["k8s", "--name", "tp", "--image", "i", "--nnodes", "2", "--nproc-per-node", "2", "--strategy",
                 "sharded", "--mesh", "dp=2,tp=2", "-o", str(target), "t.py"]) == 0
    assert "--strategy-option mesh=dp=2,tp=2" in target.read_text()


def test_the_plan_for_towers_gpt_splits_heads_and_mlp_units_and_the_head_when_the_vocabulary_divides():
    plan = tp_plan_for(GPT(GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=4, n_embd=32)), 2)
    assert plan == {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise",
                    "blocks.*.mlp.2": "rowwise", "head": "colwise_rep"}
    assert "head" not in tp_plan_for(GPT(GPTConfig.tiny()), 2)  # vocabulary 97


def test_a_slice_of_whole_heads_of_towers_gpt_attention_is_its_own_attention():
    """What tensor parallelism relies on: qkv's outputs head by head, so the first half of its rows (and of proj's
    columns) computes the first half of the heads, and the two halves' outputs sum to the whole layer's."""
    torch.manual_seed(0)
    attn = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_embd=32)).blocks[0].attn
    x = torch.randn(2, 8, 32)
    whole = attn(x)
    halves = []
    for part in range(2):
        piece = type(attn).__new__(type(attn))
        nn.Module.__init__(piece)
        piece.n_head, piece.dropout = attn.n_head, 0.0
        rows = slice(part * 48, (part + 1) * 48)
        piece.qkv = nn.Linear(32, 48)
        piece.proj = nn.Linear(16, 32, bias=part == 0)
        with torch.no_grad():
            piece.qkv.weight.copy_(attn.qkv.weight[rows])
            piece.qkv.bias.copy_(attn.qkv.bias[rows])
            piece.proj.weight.copy_(attn.proj.weight[:, part * 16:(part + 1) * 16])
            if part == 0:
                piece.proj.bias.copy_(attn.proj.bias)
        halves.append(piece(x))
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-6)


def test_hugging_face_models_bring_their_own_plan():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    plan = tp_plan_for(model, 2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_rep"  # transformers' own "colwise_gather_output": the vocabulary split
    assert "lm_head" not in tp_plan_for(transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=63, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)), 2)  # 63 rows stay whole
    check_divisible(model, plan, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads must divide by tp.*num_key_value_heads=2, tp=4"):
        check_divisible(model, plan, 4)


def test_hugging_face_gpt2_gets_a_plan_for_its_conv1d_layers_with_q_k_v_split_head_by_head():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=2,
                                                                 n_head=4))
    plan = tp_plan_for(model, 2)
    assert plan == {"transformer.h.*.attn.c_attn": "conv1d_colwise_qkv", "transformer.h.*.attn.c_proj": "conv1d_rowwise",
                    "transformer.h.*.mlp.c_fc": "conv1d_colwise", "transformer.h.*.mlp.c_proj": "conv1d_rowwise"}
    check_divisible(model, plan, 2)
    with pytest.raises(ValueError, match=r"n_head must divide by tp.*n_head=4, tp=3"):
        check_divisible(model, plan, 3)


def test_a_plan_is_checked_against_the_model_before_anything_splits():
    model = GPT(GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_head=4, n_embd=36))
    with pytest.raises(ValueError, match=r"n_head must divide by tp.*n_head=4, tp=3"):
        check_divisible(model, tp_plan_for(model, 3), 3)
    mlp = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 8))
    with pytest.raises(ValueError, match=r"Layer 0 cannot be split over tp=4. Received: 10 features"):
        check_divisible(mlp, {"0": "colwise", "2": "rowwise"}, 4)
    with pytest.raises(ValueError, match=r"matches no module.*'blocks\.\*\.fc1'"):
        check_divisible(mlp, {"blocks.*.fc1": "colwise"}, 2)
    with pytest.raises(ValueError, match="towers has no tensor-parallel plan for Sequential"):
        tp_plan_for(mlp, 4)  # its only MLP's 10 hidden units do not divide by 4
    with pytest.raises(ValueError, match="towers has no tensor-parallel plan for Conv2d"):
        tp_plan_for(nn.Conv2d(1, 4, 3), 2)
    assert tp_plan_for(mlp, 2, lambda m, tp: {"0": "colwise", "2": "rowwise"}) == {"0": "colwise", "2": "rowwise"}


def test_the_mlps_of_a_sequential_split_colwise_then_rowwise():
    from towers.models import SeedCNN

    assert tp_plan_for(SeedCNN(), 2) == {"4": "colwise", "6": "rowwise"}  # Linear(5408, 64), ReLU, Linear(64, 10)
    deep = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.0), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2),
                         nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 2)))
    # Dropout is not elementwise-safe on a slice (each process would draw its own mask): the first run stops there.
    assert tp_plan_for(deep, 2) == {"3": "colwise", "5": "rowwise", "6.0": "colwise", "6.2": "rowwise"}
    check_divisible(deep, tp_plan_for(deep, 2), 2)


# --- sequence parallelism -------------------------------------------------------------------------------------------

GPT_SEQUENCE_PLAN = {
    "blocks.0": "split_sequence",  # the embeddings' sum (whole) is cut into this process's slice of the sequence
    "blocks.*.ln_1": "sequence_parallel", "blocks.*.ln_2": "sequence_parallel",
    "blocks.*.attn": "gather_sequence", "blocks.*.mlp": "gather_sequence",
    "blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise_seq",
    "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise_seq",
    "ln_f": "sequence_parallel_gather",
}


def test_the_sequence_parallel_plan_for_towers_gpt_splits_norms_and_residual_on_the_sequence():
    model = GPT(GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=4, n_embd=32))
    assert tp_plan_for(model, 2, sequence_parallel=True) == {**GPT_SEQUENCE_PLAN, "head": "colwise_rep"}
    assert tp_plan_for(GPT(GPTConfig.tiny()), 2, sequence_parallel=True) == GPT_SEQUENCE_PLAN  # head whole: vocab 97
    check_divisible(model, tp_plan_for(model, 2, sequence_parallel=True), 2)
    assert tp_plan_for(model, 2, GPT_SEQUENCE_PLAN, sequence_parallel=True) == GPT_SEQUENCE_PLAN  # written: kept


def test_every_sequence_style_string_is_the_torch_style_it_names():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    from towers.parallel.sequence_parallel import GatherSequence, SequenceParallelGather, SplitSequence
    from towers.parallel.tensor_parallel import _style

    assert type(_style("sequence_parallel", "n")) is SequenceParallel
    rowwise = _style("rowwise_seq", "p")
    assert type(rowwise) is RowwiseParallel and rowwise.output_layouts == (Shard(1),)  # reduce-scatter onto slices
    assert [type(_style(s, "m")) for s in ("split_sequence", "gather_sequence", "sequence_parallel_gather")] == [
        SplitSequence, GatherSequence, SequenceParallelGather]
    with pytest.raises(ValueError, match=r"names a style towers does not know. Received: 'seq'.*'rowwise_seq'"):
        _style("seq", "m")


def test_hugging_face_llama_gets_the_sequence_parallel_variant_of_its_plan():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    plan = tp_plan_for(transformers.LlamaForCausalLM(config), 2, sequence_parallel=True)
    layers = "model.layers.*"
    assert plan == {
        "model.layers.0": "split_sequence",
        f"{layers}.input_layernorm": "sequence_parallel", f"{layers}.post_attention_layernorm": "sequence_parallel",
        f"{layers}.self_attn": "gather_sequence", f"{layers}.mlp": "gather_sequence",
        **{f"{layers}.self_attn.{p}_proj": "colwise" for p in "qkv"}, f"{layers}.self_attn.o_proj": "rowwise_seq",
        f"{layers}.mlp.gate_proj": "colwise", f"{layers}.mlp.up_proj": "colwise", f"{layers}.mlp.down_proj": "rowwise_seq",
        "model.norm": "sequence_parallel_gather", "lm_head": "colwise_rep"}


class _NoFinalNorm(nn.Module):
    def __init__(self, block_extra: nn.Module | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(8), "mlp": nn.Sequential(
            nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), **({"extra": block_extra} if block_extra else {})})
            for _ in range(2))


def test_a_plan_without_the_shape_sequence_parallelism_needs_is_refused_naming_what_is_missing():
    mlp = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 8))
    with pytest.raises(ValueError, match=r"cannot derive a sequence-parallel plan for Sequential: the split layers "
                                         r"must be inside modules of one stack of blocks.*Received: \['0', '2'\]"):
        tp_plan_for(mlp, 2, {"0": "colwise", "2": "rowwise"}, sequence_parallel=True)
    plan = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
    with pytest.raises(ValueError, match=r"followed by one final norm.*Received: norms \[\]"):
        tp_plan_for(_NoFinalNorm(), 2, plan, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"blocks\.\*\.extra \(Linear\) is neither"):
        tp_plan_for(_NoFinalNorm(nn.Linear(8, 8)), 2, plan, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"only from 'colwise', 'rowwise' and 'colwise_rep'.*'packed_colwise'"):
        tp_plan_for(_NoFinalNorm(), 2, {**plan, "blocks.*.mlp.1": "packed_colwise"}, sequence_parallel=True)


def test_a_sequence_that_does_not_divide_by_tp_is_refused_naming_both_numbers():
    from towers.parallel.sequence_parallel import SplitSequence

    class TwoProcesses:  # what the style reads of the mesh before anything is sent
        def size(self) -> int:
            return 2

    block = SplitSequence()._apply(nn.Identity(), TwoProcesses())
    with pytest.raises(ValueError, match=r"sequence length must divide by tp.*Received: 15 tokens per sequence "
                                         r"\(activations of shape \(2, 15, 4\)\), tp=2. Pad or cut the sequences to a "
                                         r"multiple of 2 tokens, or use sequence_parallel=False"):
        block(torch.zeros(2, 15, 4))


@pytest.mark.parametrize("option", ["sequence_parallel", "loss_parallel"])
def test_sequence_and_loss_parallel_are_strategy_options_ignored_with_a_warning_without_tp(caplog, option):
    import logging

    from towers.cluster.info import ProcessInfo
    from towers.cluster.strategy_options import parse_strategy_options
    from towers.strategies.fully_sharded import FullyShardedStrategy
    from towers.strategies.registry import check_strategy_options

    options = parse_strategy_options([f"{option}=true"])
    assert options == {option: True}
    check_strategy_options("sharded", options)  # the sharded strategy takes it
    with pytest.raises(ValueError, match=f"does not take the option '{option}'"):
        check_strategy_options("mirrored", options)
    with pytest.raises(ValueError, match=rf"{option} must be True or False. Received: 'yes'"):
        FullyShardedStrategy(info=ProcessInfo(), **{option: "yes"})
    logger = logging.getLogger("towers")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="towers"):
            strategy = FullyShardedStrategy(info=ProcessInfo(), **{option: True})
    finally:
        logger.removeHandler(caplog.handler)
    assert strategy.tensor_parallel_size == 1
    assert f"{option}=True is ignored" in caplog.text and "no mesh" in caplog.text
    assert "--mesh dp=D,tp=T" in caplog.text


class _TitanAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))


class _TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), nn.Linear(
            dim, hidden, bias=False)


class _TitanBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attention, self.feed_forward = _TitanAttention(dim), _TitanFeedForward(dim, 2 * dim)


def test_a_model_laid_out_as_torchtitans_llama3_gets_torchtitans_plan():
    """Module names as torchtitan's Llama 3 (torchtitan itself is not installed here): its own plan, heads checked."""
    from types import SimpleNamespace

    model = nn.Module()
    model.tok_embeddings = nn.Embedding(64, 32)
    model.layers = nn.ModuleDict({str(i): _TitanBlock(32) for i in range(2)})
    model.norm, model.output = nn.LayerNorm(32), nn.Linear(32, 64, bias=False)
    model.model_args = SimpleNamespace(n_heads=4, n_kv_heads=None)
    plan = tp_plan_for(model, 2)
    assert plan == {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
                    "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
                    "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
                    "layers.*.feed_forward.w2": "rowwise", "output": "colwise_rep"}
    check_divisible(model, plan, 2)
    with pytest.raises(ValueError, match=r"n_heads must divide by tp.*n_heads=4, tp=3"):
        check_divisible(model, plan, 3)
