"""Mixed precision: policy names, autocast of the prepared model only, fp16 loss scaling and skipped steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.strategies.precision import MixedPrecisionModule, Precision, resolve_precision
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
    model = MixedPrecisionModule(nn.Linear(4, 3), Precision("bf16", "cpu"))
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model.module.weight.grad.dtype == torch.float32  # master weights stay float32


def _fp16_pair(lr=0.5):
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), precision="fp16")
    model = nn.Linear(4, 3)
    model.load_state_dict(reference.state_dict())
    prepared, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
    return strategy, reference, model, prepared, opt


def test_fp16_scales_the_whole_loss_including_a_penalty_outside_the_model():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    strategy, reference, model, prepared, opt = _fp16_pair()

    def step():
        loss = towers.compute_average_loss(F.cross_entropy(prepared(x), y, reduction="none"))
        loss = loss + 0.1 * model.weight.pow(2).sum()  # a penalty the model's forward never sees
        strategy.backward(loss)
        scaled = model.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        return scaled

    scale = strategy.precision.scale
    scaled_grad = strategy.run(step)
    (F.cross_entropy(reference(x), y) + 0.1 * reference.weight.pow(2).sum()).backward()
    assert torch.allclose(scaled_grad / scale, reference.weight.grad, atol=1e-2)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert torch.allclose(model.weight, reference.weight, atol=1e-2)
    assert not opt.last_step_skipped and opt.iterations == 1


def test_fp16_clip_grad_norm_unscales_first_and_the_step_does_not_unscale_twice():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    strategy, reference, model, prepared, opt = _fp16_pair()

    def step():
        strategy.backward(towers.compute_average_loss(F.cross_entropy(prepared(x), y, reduction="none")))
        norm = strategy.clip_grad_norm_(model.parameters(), max_norm=0.05)
        opt.step()
        return norm

    norm = strategy.run(step)
    F.cross_entropy(reference(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert torch.allclose(norm, ref_norm, rtol=1e-2)  # the unscaled norm, not scale x norm
    assert torch.allclose(model.weight, reference.weight, atol=1e-3)


def test_fp16_refuses_a_step_after_a_plain_loss_backward():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    strategy, _, model, prepared, opt = _fp16_pair()
    before = model.weight.detach().clone()

    def step():
        towers.compute_average_loss(F.cross_entropy(prepared(x), y, reduction="none")).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"strategy.backward\(loss\)` instead of `loss.backward\(\)"):
        strategy.run(step)
    assert torch.equal(model.weight, before)


def test_fp16_skips_the_step_on_inf_and_lowers_the_scale():
    strategy = OneDeviceStrategy("cpu", info=ProcessInfo(), precision="fp16")
    opt_model = nn.Linear(2, 1)
    model, opt = strategy.prepare(opt_model, torch.optim.SGD(opt_model.parameters(), lr=1.0))
    before = opt_model.weight.detach().clone()
    scale = strategy.precision.scale

    def step():
        strategy.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())
        opt.step()

    strategy.run(step)
    assert opt.last_step_skipped and opt.iterations == 0 and torch.equal(opt_model.weight, before)
    assert strategy.precision.scale == scale / 2
    assert strategy.state_dict(model)["precision"]["scale"] == scale / 2


def test_backward_is_plain_backward_without_fp16():
    precision = Precision("bf16", "cpu")
    loss = torch.tensor(2.0, requires_grad=True)
    assert precision.scale_loss(loss) is loss and precision.state_dict() == {}
