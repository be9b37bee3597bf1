"""Checkpoints of a custom loop: a user's own dict in and out, clear errors, and a keep-N manager."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import towers
from towers import checkpoint as ckpt
from towers.checkpoint import CheckpointError, CheckpointManager


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_users_dict_round_trips_with_weights_only(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()
    schedule.step()
    path = ckpt.save_checkpoint(tmp_path / "c.pt", {"model": model, "optimizer": optimizer, "schedule": schedule,
                                                    "epoch": 3, "notes": {"best": [0.5, None, "x"]},
                                                    "ema": torch.arange(3.0)})
    raw = torch.load(path / "state.pt", weights_only=True)  # nothing in it needs unpickling of classes
    assert raw["state"]["epoch"] == 3

    fresh_model, fresh_optimizer = _model_and_optimizer(1)
    fresh_schedule = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
    assert not torch.equal(fresh_model[0].weight, model[0].weight)
    state = ckpt.restore_checkpoint(path, {"model": fresh_model, "optimizer": fresh_optimizer,
                                           "schedule": fresh_schedule})
    assert state["epoch"] == 3 and state["notes"] == {"best": [0.5, None, "x"]}
    assert torch.equal(state["ema"], torch.arange(3.0))
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(0.005)  # the scheduler's halved rate
    assert fresh_schedule.last_epoch == 1


def test_a_prepared_model_goes_through_the_strategy(tmp_path):
    strategy = towers.OneDeviceStrategy("cpu")
    model, optimizer = _model_and_optimizer(0)
    model, optimizer = strategy.prepare(model, optimizer)
    path = ckpt.save_checkpoint(tmp_path / "c.pt", {"model": model, "optimizer": optimizer, "step": 7},
                                strategy=strategy)
    other_model, other_optimizer = strategy.prepare(*_model_and_optimizer(2))
    state = ckpt.restore_checkpoint(path, {"model": other_model, "optimizer": other_optimizer}, strategy=strategy)
    assert state["step"] == 7
    assert set(state["model"]) == set(strategy.unwrap(model).state_dict())  # the user's module's own keys
    for a, b in zip(strategy.unwrap(model).parameters(), strategy.unwrap(other_model).parameters()):
        assert torch.equal(a, b)


def test_errors_name_the_key_and_the_fix(tmp_path):
    model, _ = _model_and_optimizer()
    with pytest.raises(CheckpointError, match=r"'config' is a Config.*weights_only=True.*state_dict"):
        class Config:
            pass
        ckpt.save_checkpoint(tmp_path / "a.pt", {"model": model, "config": Config()})
    with pytest.raises(CheckpointError, match=r"'stats'\['mean'\] is a ndarray.*torch.from_numpy"):
        ckpt.save_checkpoint(tmp_path / "b.pt", {"stats": {"mean": np.zeros(3)}})
    with pytest.raises(CheckpointError, match=r"keys must be strings. Received: \[1\]"):
        ckpt.save_checkpoint(tmp_path / "c.pt", {1: 1})
    assert not list(tmp_path.iterdir())  # nothing half-written
    path = ckpt.save_checkpoint(tmp_path / "d.pt", {"model": model})
    with pytest.raises(CheckpointError, match=r"has no \['optimizer'\]; it holds \['model'\]"):
        ckpt.restore_checkpoint(path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=1)})
    with pytest.raises(CheckpointError, match="does not fit this model: missing keys"):
        ckpt.restore_checkpoint(path, {"model": nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2),
                                                              nn.Linear(2, 2))})

    class Wrapper(nn.Module):  # what DDP looks like from outside: the user's module under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    wrapped = ckpt.save_checkpoint(tmp_path / "e.pt", {"model": Wrapper(model)})  # no strategy to unwrap it
    with pytest.raises(CheckpointError, match=r"'module.' prefix.*strategy=strategy"):
        ckpt.restore_checkpoint(wrapped, {"model": model})


def test_manager_keeps_the_newest_n_and_restores_the_latest(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", max_to_keep=2)
    model, optimizer = _model_and_optimizer(0)
    assert manager.latest_checkpoint is None and manager.restore({"model": model}) is None  # a fresh start
    for epoch in range(4):
        with torch.no_grad():
            model[0].bias.fill_(float(epoch))
        manager.save({"model": model, "optimizer": optimizer, "epoch": epoch})
    assert [p.name for p in manager.checkpoints] == ["ckpt-2", "ckpt-3"]
    assert manager.latest_checkpoint == tmp_path / "ckpt" / "ckpt-3"
    intruder = subprocess.run(  # a second job on the same folder is refused while the first runs
        [sys.executable, "-c", "import sys; from towers.checkpoint import CheckpointManager; "
         "CheckpointManager(sys.argv[1]).save({'epoch': 9})", str(tmp_path / "ckpt")], capture_output=True, text=True)
    assert intruder.returncode == 1 and "Another job is writing checkpoints to" in intruder.stderr
    assert f"pid {os.getpid()}" in intruder.stderr
    manager.close()  # the first job ends

    other, other_optimizer = _model_and_optimizer(1)
    again = CheckpointManager(tmp_path / "ckpt", max_to_keep=2)  # a restarted job
    state = again.restore({"model": other, "optimizer": other_optimizer})
    assert state["epoch"] == 3 and torch.equal(other[0].bias, torch.full((4,), 3.0))
    older = again.restore({"model": other}, path=again.checkpoints[0])
    assert older["epoch"] == 2 and torch.equal(other[0].bias, torch.full((4,), 2.0))
    assert again.save({"epoch": 4}, checkpoint_number=10).name == "ckpt-10"
    assert [p.name for p in again.checkpoints] == ["ckpt-3", "ckpt-10"]
    again.close()

    keep_all = CheckpointManager(tmp_path / "all", max_to_keep=None, prefix="step")
    for _ in range(3):
        keep_all.save({"x": 1})
    assert [p.name for p in keep_all.checkpoints] == ["step-0", "step-1", "step-2"]
    keep_all.close()
    with pytest.raises(ValueError, match="max_to_keep must be a positive integer.*Received: 0"):
        CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="prefix must be"):
        CheckpointManager(tmp_path, prefix="a/b")


def test_the_manager_saves_on_the_configured_preemption_signal(tmp_path, monkeypatch):
    import signal

    from towers.checkpoint import Preempted

    monkeypatch.setenv("TOWERS_PREEMPTION_SIGNALS", "USR2")
    manager = CheckpointManager(tmp_path / "ckpt")
    try:
        assert manager.preemption.signals == (signal.SIGUSR2,)
        model, optimizer = _model_and_optimizer(0)
        manager.save_if_preempted({"model": model, "step": 1}, step=1)  # no notice: nothing happens
        assert manager.checkpoints == []
        os.kill(os.getpid(), signal.SIGUSR2)  # the notice (handled at once: the signal is for this process)
        with pytest.raises(Preempted) as preempted:
            manager.save_if_preempted({"model": model, "step": 2}, step=2)
        assert preempted.value.code == 75 and [p.name for p in manager.checkpoints] == ["ckpt-2"]
    finally:
        manager.close()
