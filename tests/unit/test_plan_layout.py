"""``towers.plan.estimate_layout`` / ``towers plan --mesh``: the layout's arithmetic per rank, the strategy table, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towers.cli import main
from towers.cluster import roles
from towers.plan import MESH_STRATEGIES, STRATEGIES, estimate_layout, estimate_memory


def _mlp() -> nn.Module:
    """Two linears the auto plan splits (colwise 8->16, rowwise 16->8), then a head it leaves whole."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))


def _three() -> nn.Module:
    """Three top-level entries: pp=2 puts the first two on stage 0 (the larger) and the last on stage 1."""
    return nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 4))


def _bytes(*modules: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _layout(factory, mesh: str, strategy: str = "mirrored", **kwargs):
    return estimate_layout(factory, mesh=mesh, strategy=strategy, batch_size=kwargs.pop("batch_size", 4),
                           input_shape=(8,), optimizer=kwargs.pop("optimizer", "sgd"), **kwargs)


def test_tp_halves_a_split_linears_parameters_and_keeps_the_rest_whole():
    whole = _mlp()
    (est,) = _layout(_mlp, "tp=2").stages
    colwise = (16 * 8 + 16) // 2 * 4  # rows and bias split
    rowwise = (16 * 8) // 2 * 4 + 8 * 4  # columns split, bias whole
    assert est.parameters == colwise + rowwise + _bytes(whole[3])
    assert est.gradients == est.parameters and est.ranks == (0, 1)
    assert est.num_parameters == sum(p.numel() for p in whole.parameters())


def test_tp_splits_the_activations_inside_the_split_layers():
    one = estimate_memory(_mlp, strategy="mirrored", replicas=1, batch_size=256, input_shape=(8,), optimizer="sgd")
    (split,) = _layout(_mlp, "tp=2", batch_size=256).stages
    assert split.activations < one.activations
    # The hidden layer's output (256 x 16 floats, and the ReLU's) is halved: at least 2 x 256 x 8 x 4 bytes fewer.
    assert one.activations - split.activations >= 2 * 256 * 8 * 4


def test_pp_gives_each_stage_its_modules_and_the_job_the_larger_one():
    model = _three()
    est = _layout(_three, "pp=2")
    first, second = est.stages
    assert first.parameters == _bytes(model[0], model[1]) and second.parameters == _bytes(model[2])
    assert est.peak == first.peak > second.peak
    assert [e.stage for e in est.per_rank()] == [0, 1]
    # 1F1B: the first stage holds pp micro-batches in flight, the last one.
    assert (first.microbatches_in_flight, second.microbatches_in_flight) == (2, 1)


def test_pp_and_dp_ranks_in_the_layouts_order():
    est = _layout(_three, "pp=2,dp=2", strategy="sharded")
    assert [e.ranks for e in est.stages] == [(0, 1), (2, 3)]
    assert [e.stage for e in est.per_rank()] == [0, 0, 1, 1]


def test_dp_shard_halves_under_sharded_but_not_under_mirrored():
    model = _mlp()
    (sharded,) = _layout(_mlp, "dp=2", strategy="sharded").stages
    (mirrored,) = _layout(_mlp, "dp=2", strategy="mirrored").stages
    shard = sum(torch.chunk(p.detach(), 2)[0].numel() * p.element_size() for p in model.parameters())
    assert sharded.parameters == shard == _bytes(model) // 2
    assert mirrored.parameters == _bytes(model)
    assert sharded.gathered_parameters > 0 and mirrored.gathered_parameters == 0


def test_tp_and_dp_shard_compose():
    (tp,) = _layout(_mlp, "tp=2").stages
    (both,) = _layout(_mlp, "dp=2,tp=2", strategy="fsdp").stages
    assert both.parameters == tp.parameters // 2 and both.strategy == "sharded"


def test_a_plain_dp_mesh_is_the_replica_count():
    (layout,) = _layout(_mlp, "dp=4", strategy="sharded", optimizer="adam").stages
    replicas = estimate_memory(_mlp, strategy="sharded", replicas=4, batch_size=4, input_shape=(8,), optimizer="adam")
    assert (layout.parameters, layout.gradients, layout.optimizer_state, layout.peak) == (
        replicas.parameters, replicas.gradients, replicas.optimizer_state, replicas.peak)


def test_the_strategies_come_from_the_strategy_table():
    assert STRATEGIES == tuple(e.name for e in roles.STRATEGIES if e.plan_memory)
    assert set(MESH_STRATEGIES) == {"mirrored", "sharded"}
    assert "ps" not in STRATEGIES


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ps"}, r"strategy must be one of one_device, mirrored, .*sharded.*not model ps.*Received: 'ps'"),
    ({"strategy": "parameter_server"}, "Received: 'parameter_server'"),
    ({"strategy": "one_device"}, r"--mesh\) applies to the strategies mirrored, sharded.*--strategy one_device"),
    ({"strategy": "mwms"}, r"applies to the strategies mirrored, sharded"),
    ({"mesh": "dp=2,xp=2"}, "Unknown mesh dimension. Received: 'xp'"),
    ({"mesh": "dp=3,tp=2", "world_size": 4}, r"must span the job's 4 process\(es\)"),
    ({"mesh": "tp=3"}, "no tensor-parallel plan for Sequential"),  # 16 hidden units do not divide by 3
])
def test_errors_name_what_works(kwargs, match):
    options = {"mesh": "dp=2,tp=2", "strategy": "sharded", **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_layout(_mlp, batch_size=2, input_shape=(8,), **options)


def test_cli_mesh_prints_a_per_rank_table(tmp_path, monkeypatch, capsys):
    (tmp_path / "net.py").write_text("from torch import nn\ndef build():\n"
                                     "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "net.py:build", "--input-shape", "8", "--mesh", "pp=2,tp=2", "--strategy",
                 "sharded"]) == 0
    out = capsys.readouterr().out
    assert "ranks 0-1 (stage 0)" in out and "ranks 2-3 (stage 1)" in out and "mesh pp=2" in out
    assert main(["plan", "--model", "net.py:build", "--input-shape", "8", "--mesh", "dp=2", "--strategy", "ps"]) == 2
    assert "strategy must be one of" in capsys.readouterr().err
    assert main(["plan", "--model", "net.py:build", "--input-shape", "8", "--processes", "4"]) == 2
    assert "without --mesh" in capsys.readouterr().err
