"""prepare(..., compile=...): torch.compile after the strategy's own wrapping, same maths, clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo


def _train(compile):
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model, opt = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), compile=compile)
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(30, 5, generator=g), torch.randint(0, 3, (30,), generator=g))

    def step(x, y):
        strategy.backward(towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")))
        opt.step()
        opt.zero_grad()

    for x, y in strategy.distribute_dataset(data, 8):
        strategy.run(step, args=(x, y))
    return strategy, model, net


def test_compiled_training_matches_eager_and_unwrap_gives_the_users_module():
    _, _, eager = _train(False)
    strategy, model, net = _train({"backend": "aot_eager"})
    assert model is not net and strategy.unwrap(model) is net
    assert list(strategy.state_dict(model)["model"]) == list(eager.state_dict())  # no "_orig_mod." prefixes
    for a, b in zip(net.parameters(), eager.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_no_cxx_compiler_is_an_error_naming_the_ways_on(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler.*'aot_eager'.*compile=False"):
        _train(True)


def test_a_bad_compile_value_is_explained():
    with pytest.raises(TypeError, match="compile must be True, False or a dict.*Received: 'yes'"):
        _train("yes")
