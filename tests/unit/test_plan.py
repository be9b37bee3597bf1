"""``towers.plan``: exact counts against what plain torch allocates for the same model, sharding, errors, the CLI."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from towers.cli import main
from towers.plan import estimate_memory, estimate_memory_table, format_table


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 33), nn.BatchNorm1d(33), nn.ReLU(), nn.Linear(33, 7))


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _real_state_bytes(optimizer_name: str) -> tuple[nn.Module, int]:
    """Plain torch: one step of the real model and optimizer; the bytes of every tensor in the optimizer's state."""
    model = _model()
    opt = {"adam": lambda p: torch.optim.Adam(p), "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
           "sgd": lambda p: torch.optim.SGD(p, lr=0.1)}[optimizer_name](model.parameters())
    F.cross_entropy(model(torch.randn(4, 10)), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return model, state


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "sgd"])
def test_counts_match_the_real_model_and_optimizer(optimizer):
    model, state = _real_state_bytes(optimizer)
    est = estimate_memory(_model, strategy="mirrored", replicas=2, batch_size=4, input_shape=(10,), optimizer=optimizer)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.num_parameters == sum(p.numel() for p in model.parameters())
    assert est.parameters == _param_bytes(model) + buffers
    assert est.gradients == sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    assert est.optimizer_state == state  # Adam: 2x the parameters in float32 plus a step count each; momentum: 1x


def test_sharded_divides_by_replicas_as_fsdp_chunks_dim_0():
    model = _model()
    est = estimate_memory(_model, strategy="sharded", replicas=4, batch_size=4, input_shape=(10,), optimizer="adam")
    # Rank 0's shard of each parameter: torch.chunk's first piece of dim 0 (FSDP2 pads the others to its size).
    shard = sum(torch.chunk(p.detach(), 4)[0].numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.parameters == shard + buffers and est.gradients == shard
    assert est.optimizer_state == 2 * shard + 4 * len(list(model.parameters()))
    assert est.gathered_parameters > 0
    full = estimate_memory(_model, strategy="sharded", replicas=1, batch_size=4, input_shape=(10,))
    assert full.parameters == _param_bytes(model) + buffers and full.gathered_parameters == 0
    assert math.ceil(33 / 4) * 10 * 4 <= est.gradients < _param_bytes(model)


def test_activations_and_gradients_traced_on_fake_tensors():
    """The trace allocates nothing real, and its gradients are the real model's gradient bytes."""
    from towers.plan.estimate import trace_model

    trace = trace_model(_model, batch_size=64, input_shape=(10,), seq_len=None, vocab_size=None, precision="32",
                        optimizer="adam", loss="cross_entropy")
    assert trace.gradients == _param_bytes(_model())
    # At least the saved outputs of both linears and the batch norm (64 x 33 float32 each) and the input.
    assert trace.activations >= 3 * 64 * 33 * 4 + 64 * 10 * 4
    assert trace.with_gradients >= trace.activations


def test_token_model_and_a_factory_path(tmp_path, monkeypatch):
    (tmp_path / "lm.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 100))\n")
    monkeypatch.chdir(tmp_path)
    (est,) = estimate_memory_table("lm.py:build", replicas=[2], batch_size=3, seq_len=5, optimizer="sgd")
    assert est.optimizer_state == 0 and est.parameters == (100 * 16 + 16 * 100 + 100) * 4
    assert est.activations >= 3 * 5 * 100 * 4  # the logits


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ps"}, "strategy must be one of one_device, mirrored, multi_worker_mirrored, sharded.*Received: 'ps'"),
    ({"replicas": 0}, "replicas must be an integer >= 1. Received: 0"),
    ({"optimizer": "lamb"}, "optimizer must be one of"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"input_shape": None}, "needs the shape of one input"),
])
def test_errors_say_what_was_expected_and_the_fix(kwargs, match):
    options = {"batch_size": 2, "input_shape": (10,), **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_memory(_model, **options)


def test_a_failing_factory_is_named():
    def broken() -> nn.Module:
        raise RuntimeError("weights.pt not found")

    with pytest.raises(ValueError, match="factory failed.*weights.pt not found"):
        estimate_memory(broken, batch_size=2, input_shape=(10,))


def test_cli_prints_a_table_per_replica_count(tmp_path, monkeypatch, capsys):
    (tmp_path / "net.py").write_text("from torch import nn\ndef build():\n    return nn.Linear(8, 4)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "net.py:build", "--input-shape", "8", "--replicas", "1,2", "--strategy",
                 "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "1 replica" in out and "2 replicas" in out and "sharded" in out
    assert [line.split()[0] for line in out.splitlines() if line.startswith(("peak", "gradients"))] == [
        "gradients", "peak"]


@pytest.mark.parametrize("argv, match", [
    (["--model", "no_such_module:build", "--input-shape", "8"], "cannot import 'no_such_module'"),
    (["--model", "net.py:build", "--input-shape", "8", "--strategy", "bogus"], "strategy must be one of"),
    (["--model", "net.py:build", "--input-shape", "8", "--replicas", "0"], "--replicas must be"),
])
def test_cli_errors_exit_2_with_the_fix(argv, match, tmp_path, monkeypatch, capsys):
    (tmp_path / "net.py").write_text("from torch import nn\ndef build():\n    return nn.Linear(8, 4)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *argv]) == 2
    assert match in capsys.readouterr().err


def test_table_lists_every_row():
    table = format_table(estimate_memory_table(_model, replicas=[1, 4], strategy="sharded", batch_size=8,
                                               input_shape=(10,)), model_name="net")
    for row in ("parameters", "gradients", "optimizer state", "activations", "gathered parameters",
                "communication buffers", "peak"):
        assert row in table
