"""A DiLoCo job preempted in the middle of a window saves where that window ends and resumes exactly.

The real ``towers launch`` runs tests/preempt_job.py (Trainer.fit with BackupAndRestore; Adam inner
steps, so each worker's inner state differs from the other's) under ``--strategy ps
--strategy-option mode=diloco --strategy-option sync_every=4`` (2 workers + 1 ps task; DiLoCo's
Nesterov outer optimizer, whose momentum lives on the ps task): 48 steps in 3 epochs of 16, windows
ending at every 4th step. SIGUSR1 to worker rank 1 after step 6: both workers train on to step 8,
push that window, and save there (the global model, the ps task's outer momentum, each worker's
Adam state); every process exits with the restart code, the launcher restarts the job, and it
resumes at step 8 and ends with the uninterrupted run's parameters, bit for bit (every value the
resumed run uses is a saved copy of the one the uninterrupted run used, and the operations are the same). The ledger proves each example
of each epoch trained once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cli_support import run, towers_command

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parents[1] / "preempt_job.py"


def _launch(out: Path, *extra: str, restarts: int = 0) -> list[str]:
    out.mkdir(exist_ok=True)
    return [*towers_command(), "launch", "--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1",
            "--strategy-option", "mode=diloco", "--strategy-option", "sync_every=4", "--max-restarts", str(restarts),
            "--ledger", str(out / "run"), str(JOB), str(out), *extra]


def test_a_diloco_job_preempted_mid_window_saves_after_that_outer_step_and_resumes_exactly(tmp_path):
    reference = run(_launch(tmp_path / "reference"), cwd=tmp_path, deadline_s=120, marker=str(JOB))
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    assert "fresh start" in reference.stdout and "step 48" in reference.stdout

    out = tmp_path / "job"
    done = run(_launch(out, "--signal-self-at", "6", "--signal", "SIGUSR1", "--rank", "1", restarts=1),
               cwd=tmp_path, deadline_s=150, marker=str(JOB))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SIGUSR1 received" in done.stderr
    # the notice came after step 6 of the window 5..8: the workers finished that window and saved after its push
    resumed = int(re.search(r"resumed at global step (\d+)", done.stdout).group(1))
    assert resumed == 8, done.stdout[-3000:]
    assert "on a preemption notice; exiting for a restart" in done.stderr  # the ps task served the save, then exited

    # the global model, the outer momentum and each worker's Adam state came back: the same bits as uninterrupted
    final, expected = (torch.load(d / "final.pt", weights_only=True) for d in (out, tmp_path / "reference"))
    for a, b in zip(final, expected):
        assert torch.equal(a, b), (a - b).abs().max()

    proved = run([*towers_command(), "verify", "--ledger", str(out / "run")], cwd=out, deadline_s=60)
    assert proved.returncode == 0, proved.stdout[-3000:] + proved.stderr[-2000:]
    assert len(re.findall(r"^\d+ .*exactly once$", proved.stdout, re.M)) == 3, proved.stdout
