"""A preemption notice costs at most one step: every rank saves at one agreed step, exits for a restart, resumes there.

The real ``towers launch`` runs tests/preempt_job.py (Trainer.fit, Mirrored on 2 processes,
BackupAndRestore backing up once per epoch): 48 steps in 3 epochs.

- SIGUSR1 (SLURM's ``--signal``) to rank 1 alone after step 20, under ``--max-restarts 1``: both ranks
  save after step 21 or 22 (a boundary they agree on through the store), exit with the restart code,
  the agent restarts them, and the job resumes there and ends with an uninterrupted run's parameters.
- SIGTERM to ``towers launch`` itself (what Kubernetes sends a pod) while its ranks wait after step
  20: the agent passes it on, every rank saves, the launcher exits; started again (the pod's
  restart) on one process instead of two, the job resumes at the saved step and ends with the same parameters.
- The same job under ``--strategy ps --strategy-option mode=sync`` (2 workers + 1 ps task, whose
  parameters and Adam state the checkpoint fetches), preempted three times at seeded random
  steps: SIGTERM to the launcher, then (started again, ``--max-restarts 2``) to the ps task, then
  to worker rank 1. Each time the ps task serves while the workers save at the step after the
  notice, every process exits with the restart code, the next attempt resumes there (no more than
  one step lost), and the job ends with the uninterrupted Mirrored run's parameters (sync
  parameter servers have the same maths).

Every launch keeps a ledger (``--ledger``); ``towers verify --ledger`` then proves that each example of each
epoch was trained exactly once, the steps lost to each preemption rolled back.
"""

from __future__ import annotations

import random
import re
import signal
from pathlib import Path

import pytest
import torch

from cli_support import OutputReader, clean_env, finish, processes_running, run, start, towers_command
from towers.checkpoint import PREEMPTED_EXIT_CODE, load_checkpoint

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parents[1] / "preempt_job.py"
STEPS = 48  # 3 epochs of 256 examples in global batches of 16


def _launch(out: Path, *extra: str, restarts: int = 0, nproc: int = 2) -> list[str]:
    out.mkdir(exist_ok=True)
    return [*towers_command(), "launch", "--nproc-per-node", str(nproc), "--strategy", "mirrored",
            "--max-restarts", str(restarts), "--ledger", str(out / "run"), str(JOB), str(out), *extra]


def _assert_each_example_once(out: Path, epochs: int = 3) -> str:
    """``towers verify --ledger`` on the job's run directory: each example of each epoch trained once."""
    proved = run([*towers_command(), "verify", "--ledger", str(out / "run")], cwd=out, deadline_s=60)
    assert proved.returncode == 0, proved.stdout[-3000:] + proved.stderr[-2000:]
    assert len(re.findall(r"^\d+ .*exactly once$", proved.stdout, re.M)) == epochs, proved.stdout
    return proved.stdout


def _launch_ps(out: Path, *extra: str, restarts: int = 0) -> list[str]:
    """Ranks 0 and 1 are the workers, rank 2 the ps task."""
    out.mkdir(exist_ok=True)
    return [*towers_command(), "launch", "--nproc-per-node", "3", "--strategy", "ps", "--strategy-option", "mode=sync",
            "--max-restarts", str(restarts), "--ledger", str(out / "run"), str(JOB), str(out), *extra]


def _attempts(stdout: str) -> list[tuple[int, int]]:
    """Return, for each attempt of one launch, the global step it began at and the last step it finished."""
    attempts: list[list[int]] = []
    for line in stdout.splitlines():
        if begun := re.fullmatch(r"\[rank 0\]: attempt \d+ begins at global step (\d+)", line.strip()):
            attempts.append([int(begun.group(1))] * 2)
        elif (done := re.fullmatch(r"\[rank 0\]: step (\d+)", line.strip())) and attempts:
            attempts[-1][1] = int(done.group(1))
    return [(begin, last) for begin, last in attempts]


def _final(out: Path) -> list[torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[torch.Tensor]:
    out = tmp_path_factory.mktemp("reference")
    done = run(_launch(out), cwd=out, deadline_s=120, marker=str(JOB))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fresh start" in done.stdout and f"step {STEPS}" in done.stdout
    return _final(out)


def test_a_signal_to_one_rank_costs_at_most_one_step_and_the_restart_resumes(tmp_path, reference):
    out = tmp_path / "job"
    done = run(_launch(out, "--signal-self-at", "20", "--signal", "SIGUSR1", "--rank", "1", restarts=1), cwd=tmp_path,
               deadline_s=150, marker=str(JOB))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed = int(re.search(r"resumed at global step (\d+)", done.stdout).group(1))
    assert resumed in (21, 22), done.stdout  # the signal came after step 20: at most the step in flight is redone
    assert "SIGUSR1 received" in done.stderr
    for a, b in zip(_final(out), reference):
        assert torch.allclose(a, b, atol=1e-6)


def test_sigterm_to_the_launcher_saves_on_every_rank_and_a_new_start_resumes(tmp_path, reference):
    out = tmp_path / "job"
    proc = start(_launch(out, "--wait-at", "20"), cwd=tmp_path, env=clean_env())
    reader = OutputReader(proc)
    assert reader.wait_for_lines(1, "[rank 0]: waiting at step 20", deadline_s=120), "the job never reached step 20"
    proc.send_signal(signal.SIGTERM)  # the launcher alone, as Kubernetes signals a pod's main process
    stdout, stderr = reader.collect(timeout_s=60)
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-3000:]
    assert f"exited with code {PREEMPTED_EXIT_CODE}" in stderr or "preempted" in stderr, stderr[-3000:]
    saved = load_checkpoint(out / "backup" / "backup")
    assert saved["global_step"] in (21, 22)  # the ranks waited after step 20: nothing past it is lost

    # Started again on one process (the pod came back smaller): the same global batch, the same maths.
    again = finish([start(_launch(out, nproc=1), cwd=tmp_path, env=clean_env())], deadline_s=120, marker=str(JOB))[0]
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at global step {saved['global_step']}" in again.stdout
    for a, b in zip(_final(out), reference):
        assert torch.allclose(a, b, atol=1e-5)
    proof = _assert_each_example_once(out)
    assert "restored to epoch 1" in proof  # saved after 21 or 22 of its 48 steps (16 per epoch)


@pytest.mark.timeout(420)
def test_a_ps_job_preempted_through_the_launcher_the_ps_task_or_a_worker_loses_at_most_one_step(tmp_path, reference):
    rng = random.Random(2024)
    at_launcher, at_ps, at_worker = rng.randint(3, 12), rng.randint(17, 27), rng.randint(32, 43)
    out = tmp_path / "job"

    # 1. SIGTERM to `towers launch` (Kubernetes): its supervisors pass it to the workers and to the ps task.
    proc = start(_launch_ps(out, "--wait-at", str(at_launcher)), cwd=tmp_path, env=clean_env())
    reader = OutputReader(proc)
    assert reader.wait_for_lines(1, f"[rank 0]: waiting at step {at_launcher}", deadline_s=120), "never got there"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = reader.collect(timeout_s=90)
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-2000:] + stderr[-3000:]
    assert processes_running(str(JOB)) == []
    assert "[rank 2]: " in stderr and "SIGTERM received: serving the workers while they save" in stderr, stderr[-3000:]
    saved = load_checkpoint(out / "backup" / "backup")["global_step"]
    assert saved in (at_launcher + 1, at_launcher + 2), stdout[-2000:]  # the ranks waited after at_launcher
    ((_, last),) = _attempts(stdout)
    assert last - saved <= 1, stdout[-2000:]  # steps finished that the checkpoint does not hold

    # 2. Started again: SIGTERM to the ps task (attempt 0), then to worker rank 1 (attempt 1); attempt 2 finishes.
    again = run(_launch_ps(out, "--signal", "SIGTERM", "--signal-at", f"0:{at_ps}:2", "--signal-at",
                           f"1:{at_worker}:1", restarts=2), cwd=tmp_path, deadline_s=240, marker=str(JOB))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    attempts = _attempts(again.stdout)
    assert len(attempts) == 3 and attempts[0][0] == saved, again.stdout[-3000:]
    (_, last_ps), (after_ps, last_worker), (after_worker, last) = attempts
    assert after_ps in (at_ps + 1, at_ps + 2) and after_worker in (at_worker + 1, at_worker + 2), attempts
    assert last_ps - after_ps <= 1 and last_worker - after_worker <= 1 and last == STEPS, attempts
    # the ps task served both saves and exited with the restart code, as the workers did
    assert again.stderr.count("[rank 2]: ") and again.stderr.count(
        "on a preemption notice; exiting for a restart") >= 2, again.stderr[-3000:]
    assert f"resumed at global step {after_worker}" in again.stdout
    proof = _assert_each_example_once(out)  # ps task 0 recorded every applied share; 3 restores rolled back the rest
    assert proof.count("restored to epoch") >= 3, proof
    for a, b in zip(_final(out), reference):
        assert torch.allclose(a, b, atol=1e-5)
