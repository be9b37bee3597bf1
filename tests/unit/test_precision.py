"""Mixed precision: policy names, autocast of the prepared model only, fp16 loss scaling and skipped steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.precision import MixedPrecisionModule, PrecisionPolicy, make_grad_scaler, resolve_precision
from towers.strategies.one_device import OneDeviceStrategy

CPU = torch.device("cpu")


@pytest.mark.parametrize("spelling,name", [(None, "32"), ("fp32", "32"), (32, "32"), ("bf16", "bf16"),
                                           ("bfloat16", "bf16"), ("fp16", "fp16"), ("16-mixed", "fp16")])
def test_spellings(spelling, name):
    assert resolve_precision(spelling, CPU).name == name


def test_unknown_precision_is_explained():
    with pytest.raises(ValueError, match="one of '32', 'bf16' or 'fp16'. Received: 'int8'"):
        resolve_precision("int8", CPU)


def test_a_device_without_autocast_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    with pytest.raises(ValueError, match="lacks.*precision='32'"):
        resolve_precision("bf16", CPU)


def test_fp16_that_autocast_cannot_do_here_is_an_error_not_a_silent_fallback(monkeypatch):
    # Older torch builds disable CPU fp16 autocast with only a warning; towers refuses instead.
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: False)
    with pytest.raises(ValueError, match="cannot autocast to torch.float16 on 'cpu'. Use precision='bf16'"):
        resolve_precision("fp16", CPU)


def test_only_the_forward_is_autocast_and_outputs_are_float32():
    model = MixedPrecisionModule(nn.Linear(4, 3), PrecisionPolicy("bf16", "cpu"), None)
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model.module.weight.grad.dtype == torch.float32  # master weights stay float32


def test_fp16_scales_gradients_into_the_model_and_the_optimizer_unscales():
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), precision="fp16")
    model = nn.Linear(4, 3)
    model.load_state_dict(reference.state_dict())
    model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))

    def step():
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        scale = strategy._scaler.get_scale()
        grad = model.module.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        return scale, grad

    scale, scaled_grad = strategy.run(step)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    F.cross_entropy(reference(x), y).backward()
    assert torch.allclose(scaled_grad / scale, reference.weight.grad, atol=1e-2)
    ref_opt.step()
    assert torch.allclose(model.module.weight, reference.weight, atol=1e-2)
    assert not opt.last_step_skipped


def test_fp16_skips_the_step_on_inf_and_lowers_the_scale():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), precision="fp16")
    model, opt = strategy.prepare(nn.Linear(2, 1), None)
    opt_model = nn.Linear(2, 1)
    model, opt = strategy.prepare(opt_model, torch.optim.SGD(opt_model.parameters(), lr=1.0))
    before = opt_model.weight.detach().clone()
    scale = strategy._scaler.get_scale()

    def step():
        (model(torch.tensor([[float("inf"), 1.0]])).sum()).backward()
        opt.step()

    strategy.run(step)
    assert opt.last_step_skipped and torch.equal(opt_model.weight, before)
    assert strategy._scaler.get_scale() == scale / 2


def test_no_scaler_without_fp16():
    assert make_grad_scaler(PrecisionPolicy("bf16", "cpu")) is None
