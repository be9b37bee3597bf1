"""Pipeline parallelism without processes: the ``pp`` mesh, the split into stages, and the numbers checked first.

What runs on 4 processes (the maths against one device) is tests/distributed/test_pipeline_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import towers
from towers.cli import main
from towers.cluster.mesh import MeshSpec, parse_mesh
from towers.models_gpt import GPT, GPTConfig
from towers.parallel.pipeline import check_microbatches, check_pipeline_options, check_schedule, microbatches_for
from towers.parallel.pipeline_split import split_model

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters()]


def test_a_pp_mesh_parses_outermost_and_dp_takes_the_rest():
    assert parse_mesh("pp=2") == MeshSpec(pp=2)
    assert parse_mesh("pp=2,dp=2") == MeshSpec(pp=2, dp=2)
    assert parse_mesh("pp=2").resolved(4) == MeshSpec(pp=2, dp=2)
    assert parse_mesh({"pp": 4}).resolved(4) == MeshSpec(pp=4)
    assert MeshSpec(pp=2, dp=2).describe() == "pp=2,dp=2,tp=1" and MeshSpec(dp=2, tp=2).describe() == "dp=2,tp=2"


def test_a_pp_mesh_that_does_not_span_the_processes_names_both_numbers():
    with pytest.raises(ValueError, match=r"span the job's 4 process.*pp x dp x tp = 4.*pp=3,dp=1,tp=1 \(3 processes\)"):
        MeshSpec(pp=3).resolved(4)
    with pytest.raises(ValueError, match=r"pp=2,dp=3,tp=1 \(6 processes\)"):
        MeshSpec(pp=2, dp=3).resolved(4)


def test_towers_launch_checks_a_pp_mesh_before_starting_a_process(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")  # never started
    assert main(["launch", "--nproc-per-node", "4", "--strategy", "sharded", "--mesh", "pp=3", str(script)]) == 2
    assert "pp=3,dp=1,tp=1 (3 processes)" in capsys.readouterr().err


def test_towers_gpt_splits_into_balanced_stages_under_the_original_names():
    model = _gpt()
    first, last = split_model(model, 0, 2), split_model(model, 1, 2)
    assert _names(first)[:2] == ["wte.weight", "wpe.weight"]
    assert {n.split(".")[1] for n in _names(first) if n.startswith("blocks.")} == {"0", "1"}
    assert {n.split(".")[1] for n in _names(last) if n.startswith("blocks.")} == {"2", "3"}
    assert _names(last)[-3:] == ["ln_f.weight", "ln_f.bias", "head.weight"]
    assert _names(first) + _names(last) == _names(model)  # every parameter once, in the model's order
    assert first.blocks["1"] is model.blocks[1]  # the same modules, not copies
    # uneven: the earlier stages take the extra block
    assert [split_model(model, s, 3).module_names for s in range(3)] == [
        ["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2"], ["blocks.3", "ln_f", "head"]]


def test_the_stages_in_a_row_compute_the_whole_model():
    model = _gpt()
    stages = [split_model(model, s, 2, ["blocks.1"]) for s in range(2)]
    assert stages[0].module_names == ["wte", "wpe", "blocks.0"]
    x = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.block_size))
    for stage in stages:
        stage.in_schedule = True  # as the schedule runs them
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))


def test_a_sequential_splits_where_pp_split_says_even_inside_a_stack_of_blocks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))), nn.Linear(8, 2))
    first, last = split_model(model, 0, 2, "1.2"), split_model(model, 1, 2, "1.2")
    assert first.module_names == ["0", "1.0", "1.1"] and last.module_names == ["1.2", "1.3", "2"]
    assert _names(first) + _names(last) == _names(model)
    x = torch.randn(5, 4)
    first.in_schedule = last.in_schedule = True
    torch.testing.assert_close(last(first(x)), model(x))
    assert [split_model(model, s, 3).module_names for s in range(3)] == [["0"], ["1"], ["2"]]  # balanced entries


@pytest.mark.parametrize("model, stages, split, message", [
    (None, 5, None, r"Each of the pp=5 pipeline stages needs at least one of the model's blocks. Received: 4 blocks "
                    r"for pp=5"),
    (None, 2, ["blocks.9"], r"names a block where a stage can begin in this GPT. Received: 'blocks.9'"),
    (None, 2, ["head"], r"Received: 'head'"),
    (None, 3, ["blocks.1"], r"2 module name\(s\) for pp=3. Received: 1 name\(s\)"),
    (None, 3, ["blocks.3", "blocks.1"], r"must follow the model's order"),
    (nn.Linear(2, 2), 2, None, r"splits towers' GPT and nn.Sequential models .* Received: a Linear"),
])
def test_a_split_that_cannot_be_made_is_refused_naming_the_numbers(model, stages, split, message):
    with pytest.raises(ValueError, match=message):
        split_model(model if model is not None else _gpt(), 0, stages, split)


def test_a_stage_called_directly_names_the_api_to_use():
    stage = split_model(_gpt(), 0, 2, mesh="pp=2,dp=2,tp=1")
    with pytest.raises(RuntimeError, match=r"mesh pp=2,dp=2,tp=1\) cannot be called as model\(x\): this process holds "
                                           r"stage 0 of 2 \(wte, wpe, blocks.0, \.\.\.\).*strategy.forward_backward"):
        stage(torch.zeros(1, 4, dtype=torch.long))


def test_the_pipeline_options_are_checked_before_training():
    assert check_schedule("GPipe") == "gpipe" and check_microbatches(None, 2) == 2 and check_microbatches("8", 2) == 8
    with pytest.raises(ValueError, match=r"pp_schedule names a pipeline schedule towers runs. Received: 'zb'"):
        check_schedule("zb")
    with pytest.raises(ValueError, match=r"pp_microbatches must be a positive integer. Received: 0"):
        check_microbatches(0, 2)
    check_pipeline_options(MeshSpec(pp=2, tp=2), None, "bf16")  # each stage split over tp, in bf16: built
    with pytest.raises(ValueError, match=r"fp16 does not combine with pipeline .* Received: precision='fp16'"):
        check_pipeline_options(MeshSpec(pp=2), None, "fp16")
    with pytest.raises(ValueError, match=r"shard_group_size \(HSDP\) and a pipeline mesh"):
        check_pipeline_options(MeshSpec(pp=2, dp=2), 2)
    with pytest.raises(ValueError, match=r"must span the job's 1 process"):
        towers.FullyShardedStrategy(mesh="pp=2")  # one process here
    # a share that does not divide into the micro-batches runs the largest count that divides it
    assert [microbatches_for(n, 4) for n in (8, 6, 5, 1)] == [4, 3, 1, 1]
