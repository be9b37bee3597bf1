"""towers.parallel: the layout validated once from a mesh, its groups, the one place a mesh is built, and plans that
models declare themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from towers.cluster.mesh import parse_mesh
from towers.models_gpt import GPT, GPTConfig
from towers.parallel import Layout
from towers.parallel.pipeline_split import split_model
from towers.parallel.tensor_parallel import tp_plan_for

SRC = Path(__file__).resolve().parents[2] / "src" / "towers"


def test_a_mesh_becomes_one_layout_with_hsdp_as_replicate_times_shard():
    assert Layout.from_spec(None, 4) == Layout(dp_shard=4)
    assert Layout.from_spec(None, 4, shard_group_size=2) == Layout(dp_replicate=2, dp_shard=2)
    assert Layout.from_spec(parse_mesh("tp=2"), 8, shard_group_size=2) == Layout(dp_replicate=2, dp_shard=2, tp=2)
    layout = Layout.from_spec(parse_mesh("pp=2,tp=2"), 8)
    assert (layout.pp, layout.dp, layout.tp, layout.world_size) == (2, 2, 2, 8)
    assert layout.spec() == parse_mesh("pp=2,dp=2,tp=2")
    assert layout.dims() == [("pp", 2), ("dp_shard", 2), ("tp", 2)]  # dp_shard always; others above 1
    assert Layout().dims() == [("dp_shard", 1)] and Layout().describe() == "dp_shard=1"


def test_the_layouts_groups_follow_one_rank_order():
    layout = Layout(pp=2, dp_shard=2, tp=2)  # rank = (p * dp + d) * tp + t
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.stage_ranks(5, [0, 1]) == [1, 5]  # rank 5's pipeline: the same (dp, tp) coordinate at pp 0 and 1
    assert layout.stage_ranks(5, [0, 1, 1, 0]) == [1, 5, 5, 1]  # a V: stages 0 and 3 on pp 0


@pytest.mark.parametrize("kwargs, match", [
    ({"tp": 0}, r"tp must be a positive integer. Received: tp=0"),
    ({"dp_shard": True}, r"dp_shard must be a positive integer"),
    ({"cp": 2}, r"cp parallelism is not built in towers yet. Received: cp=2"),
    ({"ep": 4}, r"ep parallelism is not built in towers yet"),
])
def test_bad_degrees_are_refused_with_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout(**kwargs)


def test_a_shard_group_that_does_not_divide_dp_is_refused_before_any_process_group():
    with pytest.raises(ValueError, match=r"must divide the number of processes \(6\). Received: 4"):
        Layout.from_spec(None, 6, shard_group_size=4)
    with pytest.raises(ValueError, match=r"must divide dp. Received: shard_group_size=3, mesh dp=4,tp=2"):
        Layout.from_spec(parse_mesh("dp=4,tp=2"), 8, shard_group_size=3)
    with pytest.raises(ValueError, match=r"must span the job's 6 process"):
        Layout.from_spec(parse_mesh("dp=2,tp=2"), 6)


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


def test_the_parallel_room_imports_neither_strategies_nor_the_models():
    bad = [(p.name, m) for p in sorted((SRC / "parallel").glob("*.py")) for m in _imports(p)
           if m.startswith(("towers.strategies", "towers.models", "towers.training"))]
    assert bad == []


def test_init_device_mesh_is_called_in_the_layout_alone():
    callers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if "init_device_mesh(" in p.read_text(encoding="utf-8"))
    assert callers == ["parallel/layout.py"]


def test_a_model_declares_its_own_tensor_parallel_plan_and_pipeline_cut():
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16)
    gpt = GPT(config)
    assert tp_plan_for(gpt, 2)["blocks.*.attn.qkv"] == "colwise" and tp_plan_for(gpt, 2)["head"] == "colwise_rep"
    assert "head" not in tp_plan_for(gpt, 3)  # 64 does not divide by 3: the head stays whole

    class Mine(nn.Module):  # a user's model with its own plan: towers takes it as it is
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

        def towers_tp_plan(self, tp: int) -> dict[str, str]:
            return {"up": "colwise", "down": "rowwise"}

    assert tp_plan_for(Mine(), 2) == {"up": "colwise", "down": "rowwise"}
    torch.manual_seed(0)
    stages = [split_model(gpt, s, 2) for s in range(2)]
    assert stages[0].module_names == ["wte", "wpe", "blocks.0", "blocks.1"]
    assert stages[1].module_names == ["blocks.2", "blocks.3", "ln_f", "head"]
    idx = torch.randint(0, 64, (2, 8))
    with torch.no_grad():  # the two stages' own forwards, chained, are the whole model's
        stages[0].in_schedule = stages[1].in_schedule = True
        out = stages[1](stages[0](idx))
        assert torch.equal(out, gpt(idx))


def test_hsdp_in_the_mesh_is_the_same_layout_as_shard_group_size():
    spec = parse_mesh("dp_replicate=2,dp_shard=2,tp=2")
    assert (spec.dp, spec.dp_shard, spec.tp) == (4, 2, 2) and spec.given() == "dp_replicate=2,dp_shard=2,tp=2"
    assert Layout.from_spec(spec, 8) == Layout.from_spec(parse_mesh("dp=4,tp=2"), 8, shard_group_size=2)
    assert Layout.from_spec(parse_mesh("dp_shard=4"), 4) == Layout(dp_shard=4)
    assert Layout.from_spec(spec, 8).spec() == spec  # and back: the launcher's MeshSpec of the layout
    with pytest.raises(ValueError, match=r"dp, or its two factors dp_replicate and dp_shard"):
        parse_mesh("dp=4,dp_shard=2")
    with pytest.raises(ValueError, match=r"say two different things. Received: shard_group_size=4"):
        Layout.from_spec(spec, 8, shard_group_size=4)
    with pytest.raises(ValueError, match=r"must span the job's 4 process.*dp_replicate=2,dp_shard=2,tp=2"):
        Layout.from_spec(spec, 4)
