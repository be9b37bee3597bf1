"""Sharded checkpoints reshard: written by 4 processes (asynchronously), resumed by 2, same maths as one device.

Phase 1 (4 processes, ``async_save=True``): 3 Adam steps, save; every rank writes only its own
shard file. Phase 2 (2 processes): a fresh model and optimizer load the checkpoint (parameters
AND Adam's moments, resharded from 4 to 2), take 2 more steps and export the full model in one
call. One device taking the same 5 steps must end at the same parameters, and the export must
hold them. Phase 2 first meets a damaged copy (a shard file changed) that only rank 1 finds damaged
(rank 0's check is switched off): both ranks raise the same error and none is left waiting; then
``CheckpointManager`` falls back from that copy to the intact one.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.checkpoint import integrity
from towers.cluster.info import ProcessInfo
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.launch import SpawnError

pytestmark = pytest.mark.timeout(240)

ATOL = 1e-5
GBS = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _data(first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batches ``first`` to ``last - 1`` of a fixed data set (5 batches of GBS)."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(GBS * 5, 6, generator=g), torch.randint(0, 3, (GBS * 5,), generator=g)
    return x[first * GBS:last * GBS], y[first * GBS:last * GBS]


def _steps(strategy, net, opt, data) -> None:
    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for x, y in strategy.distribute_dataset(data, GBS, shuffle=False):
        strategy.run(step, args=(x, y))


def _prepared(strategy):
    with strategy.scope():
        net = _model()
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
    return strategy.prepare(net, opt)


def _phase1(path: str) -> dict:
    strategy = towers.FullyShardedStrategy(timeout_s=60, shard_units=nn.Linear, async_save=True)
    net, opt = _prepared(strategy)
    _steps(strategy, net, opt, _data(0, 3))
    started = time.perf_counter()
    strategy.save_checkpoint(path, {"model": net, "optimizer": opt, "global_step": 3})
    blocking_s = time.perf_counter() - started
    strategy.wait_for_checkpoint()  # the async save is published here (also at the next save or shutdown)
    files = sorted(os.listdir(path))
    strategy.shutdown()
    return {"files": files, "blocking_s": blocking_s}


def _phase2(path: str, export: str, managed: str) -> dict:
    strategy = towers.FullyShardedStrategy(timeout_s=60, shard_units=nn.Linear)
    net, opt = _prepared(strategy)
    check = integrity.verify_file
    if strategy.process_info.rank == 0:  # rank 0 is blind to the damage: only rank 1 finds it
        integrity.verify_file = lambda *args: None
    try:
        strategy.load_checkpoint(os.path.join(managed, "ckpt-2"))
        damaged_error = None
    except towers.checkpoint.CorruptCheckpointError as exc:
        damaged_error = str(exc)
    finally:
        integrity.verify_file = check
    manager = towers.checkpoint.CheckpointManager(managed, strategy=strategy, preemption=False)
    fell_back = manager.restore({"model": net, "optimizer": opt}) is not None  # ckpt-2 is damaged: ckpt-1
    manager.close()
    state = strategy.load_checkpoint(path)
    strategy.load_state_dict(state, net, opt)
    _steps(strategy, net, opt, _data(3, 5))
    strategy.export_model(net, export)
    full = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
    strategy.shutdown()
    return {"global_step": state["global_step"], "num_replicas": towers.checkpoint.checkpoint_info(path)["num_replicas"],
            "state": full, "damaged_error": damaged_error, "fell_back": fell_back}


def _damaged_copies(path: str, managed: Path) -> None:
    """``managed/ckpt-1``: a copy of ``path``; ``ckpt-2``: another, 16 bytes of its last shard file changed."""
    managed.mkdir()
    for number in (1, 2):
        shutil.copytree(Path(path).resolve(), managed / f".ckpt-{number}.data")
        os.symlink(f".ckpt-{number}.data", managed / f"ckpt-{number}")
    shard = managed / "ckpt-2" / "__3_0.distcp"
    data, rng = bytearray(shard.read_bytes()), random.Random(0)
    start = rng.randrange(0, len(data) - 16)
    for i in range(start, start + 16):
        data[i] ^= rng.randrange(1, 256)
    shard.write_bytes(bytes(data))


def test_save_at_4_resume_at_2_matches_one_device(tmp_path):
    path, export = str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")
    saved = towers.spawn(_phase1, 4, args=(path,), timeout_s=120)
    files = saved[0]["files"]
    assert sorted(f for f in files if f.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert ".metadata" in files and Path(path).is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.") and p.resolve() != Path(path).resolve()]

    managed = tmp_path / "managed"
    _damaged_copies(path, managed)
    resumed = towers.spawn(_phase2, 2, args=(path, export, str(managed)), timeout_s=120)
    assert resumed[0]["global_step"] == 3 and resumed[0]["num_replicas"] == 4
    for rank in (0, 1):  # rank 0 did not check: it learns of the damage through DCP's gathered errors
        assert (resumed[rank]["damaged_error"] or "").startswith(
            f"Checkpoint {managed / 'ckpt-2'} is damaged: its file __3_0.distcp "), rank
        assert resumed[rank]["fell_back"], rank

    reference = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    net, opt = _prepared(reference)
    _steps(reference, net, opt, _data(0, 5))
    exported = towers.checkpoint.load_exported(export)
    for key, value in net.state_dict().items():
        for rank in (0, 1):
            assert torch.allclose(resumed[rank]["state"][key], value, atol=ATOL), (rank, key)
        assert torch.allclose(exported[key], value, atol=ATOL), key


# --- BackupAndRestore ----------------------------------------------------------------------------------
CRASH_AT_STEP = 7  # global step; backups every 3 steps, so the restart resumes after step 6


def _fit(backup_dir: str, crash_marker: str | None) -> dict:
    strategy = towers.FullyShardedStrategy(timeout_s=60, shard_units=nn.Linear)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    torch.manual_seed(0)
    with strategy.scope():
        # Dropout: the result depends on every replica's RNG stream being restored too.
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, strategy=strategy)

    class Crash(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (crash_marker and strategy.replica_id == 1 and logs["global_step"] == CRASH_AT_STEP
                    and not os.path.exists(crash_marker)):
                Path(crash_marker).touch()  # crash on the first attempt only
                os._exit(1)

    backup = towers.callbacks.BackupAndRestore(backup_dir, save_freq=3)
    history = trainer.fit((x, y), 2, 8, callbacks=[backup, Crash()])
    params = {k: v.full_tensor().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    return {"params": params, "history": history.state_dict(), "restored_from": backup.restored_from}


def _restart_then_reference(backup_dir: str, marker: str, reference_dir: str):
    return _fit(backup_dir, marker), _fit(reference_dir, None)


def test_backup_and_restore_resumes_a_sharded_job_at_the_exact_step(tmp_path):
    backup_dir, marker, reference_dir = str(tmp_path / "backup"), str(tmp_path / "crashed"), str(tmp_path / "ref")
    with pytest.raises(SpawnError) as failure:
        towers.spawn(_fit, 2, args=(backup_dir, marker), timeout_s=120)
    assert failure.value.states[1].status == "died" and os.path.exists(marker)
    results = towers.spawn(_restart_then_reference, 2, args=(backup_dir, marker, reference_dir), timeout_s=120)
    for resumed, reference in results:
        assert resumed["restored_from"] == {"epoch": 0, "step": 6, "global_step": 6}
        assert reference["restored_from"] is None
        for key, value in reference["params"].items():
            assert torch.allclose(resumed["params"][key], value, atol=1e-6), key
        for key, values in reference["history"]["history"].items():
            if key in THROUGHPUT_KEYS:  # measured: differs run to run
                continue
            assert resumed["history"]["history"][key] == pytest.approx(values, rel=1e-6), key
    assert os.listdir(backup_dir) == []  # the finished job removed its backup: the link and the shards
