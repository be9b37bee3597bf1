"""Bad input ends with one line that says what, the value and the fix: NaN losses, input widths, stale temp files."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers


def _data(n: int = 32, width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_fit_warns_once_at_the_first_non_finite_loss_and_names_terminate_on_nan():
    x, y = _data()
    model = nn.Linear(4, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit((x * float("nan"), y), epochs=2, global_batch_size=8)
    nan_warnings = [w for w in caught if "not finite" in str(w.message)]
    assert len(nan_warnings) == 1, [str(w.message) for w in caught]
    assert "TerminateOnNaN" in str(nan_warnings[0].message)


def test_fit_with_finite_losses_does_not_warn():
    x, y = _data()
    model = nn.Linear(4, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit((x, y), epochs=1, global_batch_size=8)
    assert not [w for w in caught if "not finite" in str(w.message)]


def test_a_wrong_input_width_names_the_batch_shape_and_the_fix():
    x, y = _data(width=4)
    model = nn.Linear(5, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)
    with pytest.raises(ValueError, match=r"shape \(8, 4\).*in_features"):
        trainer.fit((x, y), epochs=1, global_batch_size=8)


