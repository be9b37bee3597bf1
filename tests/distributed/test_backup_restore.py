"""BackupAndRestore on 2 Mirrored replicas: rank 1 dies mid-epoch, the job is started again with the
same backup directory, and it ends with the parameters and History of a run that never crashed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers import checkpoint
from towers.launch import SpawnError

CRASH_AT_STEP = 7  # global step; backups every 3 steps, so the restart resumes after step 6


def _fit(backup_dir: str, crash_marker: str | None):
    strategy = towers.strategy_from_env()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    torch.manual_seed(0)
    with strategy.scope():
        # Dropout: the result depends on every replica's RNG stream being restored too.
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy)

    class Crash(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (crash_marker and strategy.replica_id == 1 and logs["global_step"] == CRASH_AT_STEP
                    and not os.path.exists(crash_marker)):
                Path(crash_marker).touch()  # crash on the first attempt only
                os._exit(1)

    backup = towers.callbacks.BackupAndRestore(backup_dir, save_freq=3)
    history = trainer.fit((x, y), 3, 8, validation_data=(x, y), callbacks=[backup, Crash()])
    return {"params": [p.detach().clone() for p in trainer.unwrapped_model.parameters()],
            "history": history.state_dict(), "restored_from": backup.restored_from,
            "backup_left": os.path.exists(backup.path)}


def _restart_then_reference(backup_dir: str, marker: str, reference_dir: str):
    # The restarted job, then (in the same processes, from scratch) a run that never crashes.
    return _fit(backup_dir, marker), _fit(reference_dir, None)


def test_crashed_replica_restarts_at_the_exact_step(tmp_path):
    backup_dir, marker, reference_dir = str(tmp_path / "backup"), str(tmp_path / "crashed"), str(tmp_path / "ref")
    env = {"TOWERS_STRATEGY": "mirrored"}
    with pytest.raises(SpawnError) as failure:
        towers.spawn(_fit, 2, args=(backup_dir, marker), timeout_s=120, env=env)
    # rank 1 died; rank 0 either saw the dead peer in a collective first ("error") or was stopped
    assert failure.value.states[1].status == "died" and os.path.exists(marker)
    assert failure.value.states[0].status in ("error", "stopped")
    saved = checkpoint.load_checkpoint(Path(backup_dir) / "backup.pt")
    assert (saved["global_step"], saved["epoch"], saved["step"]) == (6, 0, 6) and len(saved["rng"]) == 2

    results = towers.spawn(_restart_then_reference, 2, args=(backup_dir, marker, reference_dir), timeout_s=120, env=env)
    for resumed, reference in results:
        assert resumed["restored_from"] == {"epoch": 0, "step": 6, "global_step": 6}
        assert reference["restored_from"] is None
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed["params"], reference["params"]))
        assert resumed["history"]["epoch"] == reference["history"]["epoch"] == [0, 1, 2]
        for key, values in reference["history"]["history"].items():
            assert resumed["history"]["history"][key] == pytest.approx(values, rel=1e-6), key
        assert not resumed["backup_left"]  # deleted after the successful run
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["params"], results[1][0]["params"]))
