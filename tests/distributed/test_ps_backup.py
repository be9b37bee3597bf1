"""BackupAndRestore brings a ps task's embedding rows and their optimizer slots back after the ps task died.

HybridStrategy, 2 workers + 1 ps task, a ShardedEmbedding with row-wise Adagrad (whose slots
change every result) and an MLP. On the first attempt the chief kills the ps task (SIGKILL) at
global step 7; backups are taken every 3 steps. The job is started again (a new, empty ps task)
with the same backup directory and must end with the parameters, table and History of a run
that never crashed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers import checkpoint
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.launch import SpawnError

pytestmark = pytest.mark.timeout(240)

CRASH_AT_STEP = 7
ENV = {"TOWERS_STRATEGY": "hybrid", "TOWERS_NUM_PS": "1"}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = towers.ShardedEmbedding(64, 4, mode="mean", optimizer="adagrad", lr=0.2, seed=1)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids):
        return self.mlp(self.table(ids)).squeeze(-1)


def _fit(backup_dir: str, crash_marker: str | None, pid_file: str) -> dict | None:
    if int(os.environ["RANK"]) == 2:  # the ps task: say where to find it, then serve
        Path(pid_file).write_text(str(os.getpid()))
    strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        return None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (48, 3), generator=g)
    y = (ids.sum(1) % 2 == 0).float()
    torch.manual_seed(0)
    with strategy.scope():
        model = Model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    trainer = towers.Trainer(model, optimizer, F.binary_cross_entropy_with_logits, strategy=strategy)

    class KillPs(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (crash_marker and strategy.is_chief and logs["global_step"] == CRASH_AT_STEP
                    and not os.path.exists(crash_marker)):
                Path(crash_marker).touch()  # the first attempt only
                os.kill(int(Path(pid_file).read_text()), signal.SIGKILL)

    backup = towers.callbacks.BackupAndRestore(backup_dir, save_freq=3)
    history = trainer.fit((ids, y), 3, 8, callbacks=[backup, KillPs()], shuffle=True)
    user = trainer.unwrapped_model
    result = {"mlp": [p.detach().clone() for p in user.mlp.parameters()],
              "table": {k: v.clone() for k, v in user.table.state_dict()["rows"].items()},
              "history": history.state_dict(), "restored_from": backup.restored_from}
    strategy.shutdown()
    return result


def _restart_then_reference(backup_dir: str, marker: str, reference_dir: str, pid_file: str):
    return _fit(backup_dir, marker, pid_file), _fit(reference_dir, None, pid_file)


def test_ps_task_killed_job_resumes_with_its_rows_and_slots(tmp_path):
    backup_dir, marker, reference_dir = str(tmp_path / "backup"), str(tmp_path / "killed"), str(tmp_path / "ref")
    pid_file = str(tmp_path / "ps.pid")
    with pytest.raises(SpawnError) as failure:
        towers.spawn(_fit, 3, args=(backup_dir, marker, pid_file), timeout_s=120, env=ENV)
    assert os.path.exists(marker) and failure.value.states[2].status == "died"
    saved = checkpoint.load_checkpoint(Path(backup_dir) / "backup")
    assert saved["global_step"] == 6
    rows = saved["model"]["table.rows"]
    assert {"ids", "weight", "slot_sum"} <= set(rows) and rows["ids"].numel() > 0
    assert float(rows["slot_sum"].abs().sum()) > 0  # Adagrad's accumulators came from the ps

    results = towers.spawn(_restart_then_reference, 3, args=(backup_dir, marker, reference_dir, pid_file),
                           timeout_s=150, env=ENV)
    assert results[2] == (None, None)
    for resumed, reference in results[:2]:
        assert resumed["restored_from"] == {"epoch": 0, "step": 6, "global_step": 6}
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed["mlp"], reference["mlp"]))
        assert resumed["table"].keys() == reference["table"].keys()
        for key, value in reference["table"].items():
            assert torch.allclose(resumed["table"][key].double(), value.double(), atol=1e-6), key
        for key, values in reference["history"]["history"].items():
            if key in THROUGHPUT_KEYS:  # measured: differs run to run
                continue
            assert resumed["history"]["history"][key] == pytest.approx(values, rel=1e-6), key
