"""The prepared model where torch code copies it, under every strategy: a plain copy, or one error naming what works.

One spawn per strategy (Mirrored 2, sharded 2, ``--mesh tp=2``, ``--mesh pp=2``, parameter servers in
sync mode with 2 workers and 1 ps, hybrid, fault tolerant with 2 groups), the same job in each: before training it
tries ``copy.deepcopy(model)``, ``pickle`` of the model, ``torch.save(model.state_dict())``, ``pickle`` of the
optimizer's state dict and torch's ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))``; it trains 4
steps of SGD with momentum (``strategy.forward_backward``, ``compute_average_loss``), updating the AveragedModel (where
there is one) and ``towers.ExponentialMovingAverage`` after each; then it evaluates with the averaged weights, runs
``torch.compile(model)`` and copies the trained model. The parent compares everything with the loop a user writes on
one device without towers (the global batch, torch's AveragedModel), to rtol 1e-5 (sums over replicas, shards and
stages in another order). Where every process holds the model whole, AveragedModel, deepcopy and pickle work and
give plain copies of the user's module; a sharded or pipelined model refuses them with one error naming
``strategy.full_state_dict`` and ``towers.ExponentialMovingAverage``, whose average equals torch's there too.
One process: tests/unit/test_model_copies.py and tests/unit/test_ema.py.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import towers
from ema_support import plain_ema

pytestmark = pytest.mark.timeout(300)

DECAY, LR, GBS, ROWS = 0.9, 0.2, 8, 32
RTOL, ATOL = 1e-5, 1e-6
SHARDED_REFUSAL = ("strategy.full_state_dict(model)", "towers.ExponentialMovingAverage")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 6, generator=g), torch.randint(0, 4, (ROWS,), generator=g)


def _plain() -> dict:
    """The one-device loop without towers: a mean over the global batch, torch's AveragedModel after each step."""
    model = _model()
    x, y = _data()
    averaged = plain_ema(model, x, y, lr=LR, decay=DECAY, batch=GBS)
    with torch.no_grad():
        return {"weights": model.state_dict(), "ema": averaged.module.state_dict(), "ema output": averaged(x)}


def _whole(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()


def _attempt(fn):  # noqa: ANN001, ANN202 (what it returned, or its error as text)
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return f"error: {type(exc).__name__}: {exc}"


def _job(checkpoint_dir: str) -> dict | None:
    """The same script under the strategy the parent's environment names."""
    strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)
    if getattr(strategy, "is_ps", False):
        return None
    with strategy.scope():
        net = _model()
        optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    model, optimizer = strategy.prepare(net, optimizer)
    out: dict = {"model type": type(model).__name__}
    out["deepcopy"] = _attempt(lambda: type(copy.deepcopy(model)).__name__)
    out["pickle"] = _attempt(lambda: type(pickle.loads(pickle.dumps(model))).__name__)
    out["torch.save(state_dict)"] = _attempt(lambda: torch.save(model.state_dict(), io.BytesIO()) or "saved")
    out["pickle(optimizer.state_dict())"] = _attempt(lambda: len(pickle.dumps(optimizer.state_dict())) > 0)
    averaged = _attempt(lambda: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY)))
    ema = towers.ExponentialMovingAverage(model, decay=DECAY, strategy=strategy)

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return towers.compute_average_loss(F.cross_entropy(outputs, targets, reduction="none"))

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        strategy.forward_backward(model, xb, yb, loss_fn)
        optimizer.step()
        optimizer.zero_grad()

    for xb, yb in strategy.distribute_dataset(_data(), GBS, shuffle=False):
        strategy.run(step, args=(xb, yb))
        ema.update()
        if not isinstance(averaged, str):
            averaged.update_parameters(model)

    x, _ = _data()
    out["weights"] = {k: _whole(v) for k, v in strategy.full_state_dict(model).items()}
    out["ema"] = {k: _whole(v) for k, v in ema.full_state_dict().items()}
    strategy.save_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer, "ema": ema})
    restored = towers.ExponentialMovingAverage(model, decay=0.5, strategy=strategy)
    strategy.restore_checkpoint(checkpoint_dir, {"ema": restored})
    out["ema from a checkpoint"] = (restored.decay, restored.num_updates,
                                    {k: _whole(v) for k, v in restored.full_state_dict().items()})
    with torch.no_grad():
        plain_output = _whole(model(x))
        with ema.average_parameters():
            out["ema output"] = _whole(model(x))
        out["restored"] = torch.equal(_whole(model(x)), plain_output)  # the training weights are back
        out["compiled"] = _attempt(lambda: torch.allclose(_whole(torch.compile(model, backend="eager")(x)), plain_output,
                                                          rtol=RTOL, atol=ATOL))
    if isinstance(averaged, str):
        out["AveragedModel"] = averaged
    else:
        out["AveragedModel"] = {k: v.detach().clone() for k, v in averaged.module.state_dict().items()}
        out["AveragedModel output"] = averaged(x).detach()
        twin = copy.deepcopy(model)  # trained: a plain copy of the user's module with its weights
        out["copy"] = {k: v.detach().clone() for k, v in twin.state_dict().items()}
        out["copy type"] = type(twin).__name__
    strategy.shutdown()
    return out


def _close(got: dict, want: dict, what: str) -> None:
    assert isinstance(got, dict), (what, got)
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=f"{what}, {key}")


def _check_restored(rank: dict, plain: dict, name: str) -> None:
    decay, updates, average = rank["ema from a checkpoint"]
    assert (decay, updates) == (DECAY, ROWS // GBS), (name, decay, updates)
    _close(average, plain["ema"], f"{name}: towers.ExponentialMovingAverage restored from a checkpoint")


def _check_whole(ranks: list[dict], plain: dict, name: str) -> None:
    """Every process holds the model whole: copies are plain copies of the user's module, AveragedModel is torch's."""
    for rank in ranks:
        assert rank["deepcopy"] == rank["pickle"] == rank["copy type"] == "Sequential", (name, rank)
        assert rank["torch.save(state_dict)"] == "saved" and rank["pickle(optimizer.state_dict())"] is True, (name, rank)
        _close(rank["weights"], plain["weights"], f"{name}: the trained weights")
        _close(rank["AveragedModel"], plain["ema"], f"{name}: torch's AveragedModel of the prepared model")
        _close(rank["ema"], plain["ema"], f"{name}: towers.ExponentialMovingAverage")
        _check_restored(rank, plain, name)
        _close(rank["copy"], plain["weights"], f"{name}: a deepcopy of the trained model")
        torch.testing.assert_close(rank["AveragedModel output"], plain["ema output"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(rank["ema output"], plain["ema output"], rtol=RTOL, atol=ATOL)
        assert rank["restored"] is True and rank["compiled"] is True, (name, rank["restored"], rank["compiled"])


def _check_in_parts(ranks: list[dict], plain: dict, name: str) -> None:
    """No process holds the model whole: copies refused with one error naming what works; towers' EMA is torch's."""
    for rank in ranks:
        for habit in ("deepcopy", "pickle", "AveragedModel"):
            message = rank[habit]
            assert isinstance(message, str) and message.startswith("error: InvalidTypeError"), (name, habit, message)
            assert all(fix in message for fix in SHARDED_REFUSAL), (name, habit, message)
        assert rank["torch.save(state_dict)"] == "saved" and rank["pickle(optimizer.state_dict())"] is True, (name, rank)
        torch.testing.assert_close(rank["ema output"], plain["ema output"], rtol=RTOL, atol=ATOL)
        assert rank["restored"] is True and rank["compiled"] is True, (name, rank["restored"], rank["compiled"])
    chief = ranks[0]  # full_state_dict gathers onto the chief (the others may get nothing)
    _close(chief["weights"], plain["weights"], f"{name}: the trained weights")
    _close(chief["ema"], plain["ema"], f"{name}: towers.ExponentialMovingAverage")
    _check_restored(chief, plain, name)


def _sharded_env(mesh: str | None = None) -> dict:
    return {"TOWERS_STRATEGY": "sharded", **({"TOWERS_STRATEGY_OPTIONS": json.dumps({"mesh": mesh})} if mesh else {})}


@pytest.fixture(scope="module")
def plain() -> dict:
    return _plain()


def test_mirrored_and_parameter_servers_copy_the_users_module(plain: dict, tmp_path: Path) -> None:
    mirrored = towers.spawn(_job, 2, args=(str(tmp_path / "mirrored"),), timeout_s=120, env={"TOWERS_STRATEGY": "mirrored"})
    _check_whole(mirrored, plain, "mirrored 2")
    for kind in ("ps", "hybrid"):  # 2 workers and 1 ps task, sync mode
        ranks = towers.spawn(_job, 3, args=(str(tmp_path / kind),), timeout_s=120,
                             env={"TOWERS_STRATEGY": kind, "TOWERS_NUM_PS": "1"})
        assert ranks[2] is None
        _check_whole(ranks[:2], plain, kind)


def test_fault_tolerant_groups_copy_the_users_module(plain: dict, tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from ft_support import lighthouse_process

    lighthouse, address = lighthouse_process(3.0)
    try:
        ranks = towers.spawn(_job, 2, args=(str(tmp_path / "ckpt"),), timeout_s=120,
                             env={"TOWERS_STRATEGY": "fault_tolerant", "TORCHFT_LIGHTHOUSE": address})
    finally:
        lighthouse.kill()
        lighthouse.wait(timeout=10)
    _check_whole(ranks, plain, "fault tolerant, 2 groups")


@pytest.mark.parametrize("mesh", [None, "tp=2", "pp=2"])
def test_a_sharded_or_pipelined_model_refuses_copies_and_averages_with_towers_ema(plain: dict, mesh: str | None,
                                                                                 tmp_path: Path) -> None:
    ranks = towers.spawn(_job, 2, args=(str(tmp_path / "ckpt"),), timeout_s=120, env=_sharded_env(mesh))
    _check_in_parts(ranks, plain, f"sharded 2, mesh {mesh}")
