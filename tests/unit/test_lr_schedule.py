"""LearningRateScheduler takes Keras's one-argument schedule(epoch) as well as schedule(epoch, lr)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.training.callbacks import LearningRateScheduler


def _fit(schedule, epochs=3):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"))
    x = torch.randn(32, 4)
    history = trainer.fit((x, (x[:, 0] > 0).long()), epochs, 16, callbacks=[LearningRateScheduler(schedule)])
    return history["lr"]


def _halve(epoch, lr, *, floor=0.0):
    return max(floor, lr / 2)


def test_one_and_two_argument_schedules():
    assert _fit(lambda epoch: 1e-3 * 0.5 ** epoch) == pytest.approx([1e-3, 5e-4, 2.5e-4])   # Keras's usual form
    assert _fit(lambda epoch, lr: lr * 0.5) == pytest.approx([0.05, 0.025, 0.0125])
    assert _fit(functools.partial(_halve, floor=0.03)) == pytest.approx([0.05, 0.03, 0.03])
    assert _fit(lambda epoch, lr=None: 0.2 if lr is not None else -1.0) == pytest.approx([0.2] * 3)  # gets lr
    assert _fit(lambda *args: 0.01 * len(args)) == pytest.approx([0.02] * 3)


def test_a_schedule_of_the_wrong_shape_is_refused_at_construction():
    with pytest.raises(TypeError, match=r"schedule\(epoch\) or schedule\(epoch, lr\).*takes 0 required"):
        LearningRateScheduler(lambda: 0.1)
    with pytest.raises(TypeError, match="takes 3 required"):
        LearningRateScheduler(lambda epoch, lr, other: 0.1)
    with pytest.raises(TypeError, match="must be a function"):
        LearningRateScheduler(0.1)
    with pytest.raises(ValueError, match=r"schedule\(epoch=0\) must return a finite float"):
        _fit(lambda epoch: float("inf"))
