"""Bad input ends with one line that says what, the value and the fix: NaN losses, input widths, stale temp files."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.checkpoint import remove_stale_temp_files
from towers.checkpoint_manager import CheckpointManager


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


def test_stale_checkpoint_temp_files_are_removed_at_start_up_and_a_live_writers_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".ckpt-2.pt.{dead_pid}.tmp"
    live = tmp_path / f".ckpt-3.pt.{os.getpid()}.tmp"
    stale.write_bytes(b"half a checkpoint")
    live.write_bytes(b"being written")
    CheckpointManager(tmp_path)
    assert not stale.exists()
    assert live.exists()
    assert remove_stale_temp_files(tmp_path) == []
