"""BackupAndRestore under Mirrored (2 replicas) and sync parameter servers (1 ps + 2 workers).

Worker/replica 1 dies mid-epoch (in sync PS mode that stops the job: the ps fails the round).
The job is started again with the same backup directory — under PS the model and optimizer state
go back to the ps tasks through ``load_state_dict`` on the prepared model and optimizer — and it
ends with the parameters and History of a run that never crashed.
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
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.launch import SpawnError

pytestmark = pytest.mark.timeout(240)

CRASH_AT_STEP = 7  # global step; backups every 3 steps, so the restart resumes after step 6

# name -> (processes, environment set by the launcher, strategy arguments)
CASES = {
    "mirrored": (2, {"TOWERS_STRATEGY": "mirrored"}, {}),
    "ps_sync": (3, {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"},
                {"mode": "sync", "timeout_s": 60, "exit_on_ps": False}),
}


def _fit(backup_dir: str, crash_marker: str | None, strategy_kwargs: dict) -> dict | None:
    strategy = towers.strategy_from_env(**strategy_kwargs)
    if getattr(strategy, "is_ps", False):
        return None  # a ps task served until the workers were done
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

    # preemption=False: the test's spawn stops the survivors with SIGTERM after the crash, which would otherwise be
    # a preemption notice (a sync ps job goes on without the dead worker and would save once more on it).
    backup = towers.callbacks.BackupAndRestore(backup_dir, save_freq=3, preemption=False)
    history = trainer.fit((x, y), 3, 8, validation_data=(x, y), callbacks=[backup, Crash()])
    result = {"params": [p.detach().clone() for p in trainer.unwrapped_model.parameters()],
              "history": history.state_dict(), "restored_from": backup.restored_from,
              "backup_left": os.path.exists(backup.path)}
    if hasattr(strategy, "ps_stats"):  # parameter servers: rounds applied, then say goodbye to the ps
        result["versions"] = strategy.ps_stats()[0]["worker_versions"]
        strategy.shutdown()
    return result


def _restart_then_reference(backup_dir: str, marker: str, reference_dir: str, strategy_kwargs: dict):
    # The restarted job, then (in the same processes, from scratch) a run that never crashes.
    return _fit(backup_dir, marker, strategy_kwargs), _fit(reference_dir, None, strategy_kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_crashed_replica_restarts_at_the_exact_step(tmp_path, case):
    nprocs, env, kwargs = CASES[case]
    backup_dir, marker, reference_dir = str(tmp_path / "backup"), str(tmp_path / "crashed"), str(tmp_path / "ref")
    with pytest.raises(SpawnError) as failure:
        towers.spawn(_fit, nprocs, args=(backup_dir, marker, kwargs), timeout_s=120, env=env)
    # replica 1 died; the others either saw the dead peer first ("error") or were stopped
    assert failure.value.states[1].status == "died" and os.path.exists(marker)
    assert all(s.status in ("error", "stopped") for s in failure.value.states if s.rank != 1)
    saved = checkpoint.load_checkpoint(Path(backup_dir) / "backup")
    assert (saved["global_step"], saved["epoch"], saved["step"]) == (6, 0, 6)
    assert len(saved["rng"]) == 2  # one RNG state per replica
    assert len(saved["optimizer"]["state"]) == 4  # Adam state of every parameter (from the ps under PS)

    results = towers.spawn(_restart_then_reference, nprocs, args=(backup_dir, marker, reference_dir, kwargs),
                           timeout_s=150, env=env)
    assert all(r == (None, None) for r in results[2:])  # the ps task, if any
    for resumed, reference in results[:2]:
        assert resumed["restored_from"] == {"epoch": 0, "step": 6, "global_step": 6}
        assert reference["restored_from"] is None
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(resumed["params"], reference["params"]))
        assert resumed["history"]["epoch"] == reference["history"]["epoch"] == [0, 1, 2]
        for key, values in reference["history"]["history"].items():
            if key in THROUGHPUT_KEYS:  # measured: differs run to run
                continue
            assert resumed["history"]["history"][key] == pytest.approx(values, rel=1e-6), key
        assert not resumed["backup_left"]  # deleted after the successful run
        if "versions" in reference:
            assert reference["versions"] == [24, 24]  # 3 epochs of 8 global batches, one round each
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["params"], results[1][0]["params"]))
