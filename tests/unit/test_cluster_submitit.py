"""submitit under SLURM, from its variables: ``from_env()`` and ``towers launch`` read its tasks, and the signal it
sends before the time limit (SIGUSR2) is a preemption notice whose save is then handed to submitit's own handler."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import towers
from towers.checkpoint import CheckpointManager, Preempted, load_checkpoint
from towers.cluster import ClusterConfigError, describe, from_env
from towers.cluster.slurm import port_from_job_id
from towers.cluster.submitit import launch_flags, preemption_signal_names
from towers.launch.spec import parse_launch_args
from towers.training import Trainer
from towers.training import callbacks as C

# One task per node of a 2-node job, as submitit's sbatch script (`export SUBMITIT_EXECUTOR=slurm`, srun) starts it.
TASK_1 = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": "/scratch/logs/4242", "SLURM_JOB_ID": "4242",
          "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
          "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "gpu[01-02]"}


def test_a_submitit_task_is_read_as_slurms_task_and_says_submitit():
    info = from_env(TASK_1)
    assert (info.source, info.rank, info.world_size, info.node_rank, info.local_world_size) == ("submitit", 1, 2, 1, 1)
    assert (info.master_addr, info.master_port) == ("gpu01", port_from_job_id(4242))
    assert info.preemption_signals == "TERM,USR1,USR2"  # submitit's signal beside towers' own
    assert "from submitit" in describe(info) and "preemption signals TERM,USR1,USR2" in describe(info)
    plain = {k: v for k, v in TASK_1.items() if not k.startswith("SUBMITIT_")}
    assert (from_env(plain).source, from_env(plain).preemption_signals) == ("slurm", None)


def test_the_preemption_signals_follow_submitit_and_towers_own_variable_wins():
    assert preemption_signal_names({**TASK_1, "SUBMITIT_PREEMPT_SIGNAL": "SIGUSR1"}) == "TERM,USR1"
    assert preemption_signal_names({**TASK_1, "SUBMITIT_PREEMPT_SIGNAL": "HUP"}) == "TERM,USR1,HUP"
    assert preemption_signal_names({**TASK_1, "TOWERS_PREEMPTION_SIGNALS": "TERM"}) == "TERM"
    assert preemption_signal_names({"SUBMITIT_EXECUTOR": "local"}) is None


def test_towers_launch_in_a_one_task_per_node_job_takes_its_node_flags_from_slurm():
    spec = parse_launch_args(["train.py"], environ=TASK_1, gpu_count=0, cpu_count=2)
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank) == (2, 2, 1)
    assert (spec.master_addr, spec.master_port) == ("gpu01", port_from_job_id(4242))
    own = parse_launch_args(["--master-addr", "10.0.0.9", "--master-port", "29400", "train.py"], environ=TASK_1,
                            gpu_count=0, cpu_count=2)
    assert (own.master_addr, own.master_port, own.node_rank) == ("10.0.0.9", 29400, 1)
    assert launch_flags({**TASK_1, "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}) == []  # tasks are the processes
    assert launch_flags({k: v for k, v in TASK_1.items() if k != "SUBMITIT_EXECUTOR"}) == []


def test_a_task_submitit_did_not_start_with_srun_names_the_fix():
    shell = {k: v for k, v in TASK_1.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(ClusterConfigError, match="submitit: set tasks_per_node"):
        from_env(shell)


def test_submitits_signal_saves_at_the_agreed_step_then_reaches_submitits_handler(tmp_path, monkeypatch):
    for key, value in TASK_1.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TOWERS_PREEMPTION_SIGNALS", raising=False)
    requeued: list[int] = []
    # submitit's own handler (checkpoint_and_try_requeue) is installed before the submitted function runs.
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: requeued.append(signum))
    manager = CheckpointManager(tmp_path / "ckpt")
    try:
        assert signal.SIGUSR2 in manager.preemption.signals
        model = torch.nn.Linear(2, 1)
        manager.save_if_preempted({"model": model, "step": 1}, step=1)  # no notice: nothing happens
        os.kill(os.getpid(), signal.SIGUSR2)  # submitit's notice (handled at once: the signal is for this process)
        assert requeued == []  # towers acts first: the checkpoint must exist before submitit requeues
        with pytest.raises(Preempted) as preempted:
            manager.save_if_preempted({"model": model, "step": 2}, step=2)
        assert preempted.value.code == 75 and [p.name for p in manager.checkpoints] == ["ckpt-2"]
        assert requeued == [signal.SIGUSR2]  # handed on after the save, before the exit
        assert not manager.preemption.installed  # the signal given back
    finally:
        manager.close()
        signal.signal(signal.SIGUSR2, previous)
    assert requeued == [signal.SIGUSR2]  # once


def test_backup_and_restore_saves_on_submitits_signal_and_hands_it_on(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # a one-task job: this process alone
    monkeypatch.delenv("TOWERS_PREEMPTION_SIGNALS", raising=False)
    requeued: list[int] = []

    class Notice(C.Callback):  # SLURM signals the task before the time limit, after the second step
        def on_train_batch_end(self, batch, logs=None):
            if logs["global_step"] == 2:
                os.kill(os.getpid(), signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: requeued.append(signum))
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                          strategy=towers.OneDeviceStrategy("cpu"))
        x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
        with pytest.raises(Preempted) as preempted:
            trainer.fit((x, (x[:, 0] > 0).long()), 1, 8, callbacks=[Notice(), C.BackupAndRestore(tmp_path)])
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert preempted.value.step == 2 and requeued == [signal.SIGUSR2]
    assert load_checkpoint(tmp_path / "backup")["global_step"] == 2
