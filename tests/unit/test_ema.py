"""``towers.ExponentialMovingAverage`` on one process: torch's EMA (``AveragedModel`` with ``get_ema_multi_avg_fn``)
without a copy of the model, its swap in and out, its state in checkpoints, and its checks.

Under every strategy (sharded and pipelined included): tests/distributed/test_model_copies.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import towers

DECAY = 0.8


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, each, steps: int = 5) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        each()


@pytest.mark.parametrize("use_buffers", [False, True])
def test_the_average_is_torchs_ema(use_buffers: bool) -> None:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=use_buffers)
    ema = towers.ExponentialMovingAverage(model, decay=DECAY, use_buffers=use_buffers)
    _steps(model, optimizer, lambda: (averaged.update_parameters(model), ema.update()))
    assert ema.num_updates == 5
    want = averaged.module.state_dict()
    got = ema.full_state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        if key.endswith("num_batches_tracked"):  # a counter: the model's (torch averages it as an integer)
            assert got[key] == model.state_dict()[key]
            continue
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)  # the same foreach lerp, bit for bit


def test_average_parameters_swaps_the_averages_in_and_the_weights_back() -> None:
    model = _net().eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = towers.ExponentialMovingAverage(model, decay=DECAY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _steps(model, optimizer, ema.update)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["0.weight"], before["0.weight"])
    x = torch.randn(3, 4)
    with ema.average_parameters() as inside:
        assert inside is model
        averaged = {k: v.clone() for k, v in model.state_dict().items()}
        for key, value in ema.full_state_dict().items():
            assert torch.equal(averaged[key], value), key
        out = model(x)
    assert not torch.equal(out, model(x))
    with pytest.raises(RuntimeError, match="inside"):
        with ema.average_parameters():
            raise RuntimeError("inside")
    for key, value in model.state_dict().items():  # back after the block, also after an error in it
        assert torch.equal(value, trained[key]), key


def test_before_the_first_update_the_average_is_the_model_at_construction_and_the_first_update_copies() -> None:
    model = _net()
    ema = towers.ExponentialMovingAverage(model, decay=0.99)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(ema.full_state_dict()[k], start[k]) for k in start)
    ema.update()
    assert all(torch.equal(ema.full_state_dict()[k], v) for k, v in model.state_dict().items())


def test_tied_weights_and_a_wrapper_keep_the_users_names() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    strategy = towers.OneDeviceStrategy("cpu", precision="bf16")  # wrapped: the prepared model's names start "module."
    model, optimizer = strategy.prepare(Tied(), None)
    assert next(iter(model.state_dict())).startswith("module.")
    ema = towers.ExponentialMovingAverage(model, decay=DECAY, strategy=strategy)
    assert ema.names == ["embed.weight"]
    ema.update()
    with torch.no_grad():
        model.module.embed.weight.mul_(2.0)
    ema.update()
    full = ema.full_state_dict()
    assert sorted(full) == ["embed.weight", "head.weight"]  # both names of the tied weight hold the average
    assert torch.equal(full["embed.weight"], full["head.weight"])
    assert not torch.equal(full["embed.weight"], model.module.embed.weight)


def test_its_state_round_trips_through_a_checkpoint(tmp_path) -> None:  # noqa: ANN001
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = towers.ExponentialMovingAverage(model, decay=DECAY)
    _steps(model, optimizer, ema.update)
    towers.checkpoint.save_checkpoint(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "ema": ema})
    fresh_model = _net()
    fresh = towers.ExponentialMovingAverage(fresh_model, decay=0.5)
    towers.checkpoint.restore_checkpoint(tmp_path / "ckpt", {"model": fresh_model, "ema": fresh})
    assert (fresh.decay, fresh.num_updates) == (DECAY, 5)
    for key, value in ema.full_state_dict().items():
        assert torch.equal(fresh.full_state_dict()[key], value), key
    with pytest.raises(ValueError, match="does not fit this model"):
        towers.ExponentialMovingAverage(nn.Linear(4, 2)).load_state_dict(ema.state_dict())


@pytest.mark.parametrize("decay", [True, -0.1, 1.5, math.nan, "0.9", None])
def test_a_bad_decay_is_refused_with_the_fix(decay) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"decay must be a number in \[0, 1\].*Received: .*decay=0.999"):
        towers.ExponentialMovingAverage(_net(), decay=decay)


def test_it_takes_a_module() -> None:
    with pytest.raises(TypeError, match="averages a module's weights. Received: list"):
        towers.ExponentialMovingAverage([nn.Linear(2, 2)])  # type: ignore[arg-type]
    assert "ExponentialMovingAverage" in towers.__all__
