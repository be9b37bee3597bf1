"""A preemption notice costs at most one step: every rank saves at one agreed step, exits for a restart, resumes there.

The real ``towers launch`` runs tests/preempt_job.py (Trainer.fit, Mirrored on 2 processes,
BackupAndRestore backing up once per epoch): 48 steps in 3 epochs.

- SIGUSR1 (SLURM's ``--signal``) to rank 1 alone after step 20, under ``--max-restarts 1``: both ranks
  save after step 21 or 22 (a boundary they agree on through the store), exit with the restart code,
  the agent restarts them, and the job resumes there and ends with an uninterrupted run's parameters.
- SIGTERM to ``towers launch`` itself (what Kubernetes sends a pod) while its ranks wait after step
  20: the agent passes it on, every rank saves, the launcher exits; started again (the pod's
  restart), the job resumes at the saved step and ends with the same parameters.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch

from cli_support import OutputReader, clean_env, finish, run, start, towers_command
from towers.checkpoint import PREEMPTED_EXIT_CODE, load_checkpoint

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parents[1] / "preempt_job.py"
STEPS = 48  # 3 epochs of 256 examples in global batches of 16


def _launch(out: Path, *extra: str, restarts: int = 0) -> list[str]:
    out.mkdir(exist_ok=True)
    return [*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "mirrored",
            "--max-restarts", str(restarts), str(JOB), str(out), *extra]


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

    again = finish([start(_launch(out), cwd=tmp_path, env=clean_env())], deadline_s=120, marker=str(JOB))[0]
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at global step {saved['global_step']}" in again.stdout
    for a, b in zip(_final(out), reference):
        assert torch.allclose(a, b, atol=1e-6)
