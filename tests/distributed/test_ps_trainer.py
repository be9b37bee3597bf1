"""``Trainer.fit`` with BackupAndRestore under ParameterServerStrategy (sync, 1 ps + 2 workers).

Worker 1 dies mid-epoch; in sync mode that stops the job (the ps fails the round, the other
worker raises). The job is started again with the same backup directory: the model and the
optimizer state go back to the ps tasks (``load_state_dict`` on the prepared model and optimizer),
and the run ends with the parameters and History of a run that never crashed.
"""

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

pytestmark = pytest.mark.timeout(240)

CRASH_AT_STEP = 7  # global step; backups every 3 steps, so the restart resumes after step 6
ENV = {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"}


def _fit(backup_dir: str, crash_marker: str | None) -> dict | None:
    strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    torch.manual_seed(0)
    with strategy.scope():
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
    result = {"params": [p.detach().clone() for p in trainer.unwrapped_model.parameters()],
              "history": history.state_dict(), "restored_from": backup.restored_from,
              "backup_left": os.path.exists(backup.path), "versions": strategy.ps_stats()[0]["worker_versions"]}
    strategy.shutdown()
    return result


def _restart_then_reference(backup_dir: str, marker: str, reference_dir: str):
    # The restarted job, then (in the same processes, from scratch) a run that never crashes.
    return _fit(backup_dir, marker), _fit(reference_dir, None)


def test_trainer_fit_resumes_from_backup_under_parameter_servers(tmp_path):
    backup_dir, marker, reference_dir = str(tmp_path / "backup"), str(tmp_path / "crashed"), str(tmp_path / "ref")
    with pytest.raises(SpawnError, match="rank 1 of 3 failed") as failure:
        towers.spawn(_fit, 3, args=(backup_dir, marker), timeout_s=120, env=ENV)
    assert failure.value.states[1].status == "died" and os.path.exists(marker)
    saved = checkpoint.load_checkpoint(Path(backup_dir) / "backup.pt")
    assert (saved["global_step"], saved["epoch"], saved["step"]) == (6, 0, 6)
    assert len(saved["optimizer"]["state"]) == 4  # Adam state of every parameter, fetched from the ps

    results = towers.spawn(_restart_then_reference, 3, args=(backup_dir, marker, reference_dir), timeout_s=150,
                           env=ENV)
    assert results[2] == (None, None)  # the ps task
    for resumed, reference in results[:2]:
        assert resumed["restored_from"] == {"epoch": 0, "step": 6, "global_step": 6}
        assert reference["restored_from"] is None
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed["params"], reference["params"]))
        assert resumed["history"]["epoch"] == reference["history"]["epoch"] == [0, 1, 2]
        for key, values in reference["history"]["history"].items():
            assert resumed["history"]["history"][key] == pytest.approx(values, rel=1e-6), key
        assert not resumed["backup_left"]
        assert reference["versions"] == [24, 24]  # 3 epochs of 8 global batches, one round each
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["params"], results[1][0]["params"]))
