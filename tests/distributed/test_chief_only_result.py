"""``metric.result()`` printed on the chief only (TensorFlow's habit): one clear error on every rank, within seconds.

``Metric.result()`` is a collective. Called on the chief alone, the others go on to their next step and
wait there for the chief. Under every strategy whose ``result()`` is a collective of the job's processes
(Mirrored with 3 replicas, sharded, sync parameter servers and hybrid with 2 workers + 1 ps), every
process must exit non-zero within ``BOUND_S`` of the call, each with ``PartialCollectiveError`` naming
``result()`` and the fix, never with the stuck-job watchdog's timeout (its bound stays the default 60 s,
and the strategies' ``timeout_s`` 300 s). The ranks find their place torchrun-style (see test_stuck.py); the
test owns the deadline and SIGKILLs anything left over.

Under ``towers launch --strategy fault_tolerant`` (2 replica groups, each its own process group, no watchdog
across them) the same: every group ends with the error within ``BOUND_S``, the job exits non-zero, and no
group is started again for it (a restart would hide the error: the other group trained on alone, exit 0).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import chief_result_job
from cli_support import OutputReader, clean_env, kill, processes_running, start, towers_command, wait_for_exits

pytestmark = pytest.mark.timeout(120)

BOUND_S = 15.0
DEADLINE_S = 60.0
JOBS = {"mirrored": (3, 0), "sharded": (2, 0), "ps": (3, 1), "hybrid": (3, 1)}  # processes, of which ps tasks


def _run_job(tmp_path: Path, strategy: str, when: str = "epoch") -> dict:
    from towers.launch.spawn import free_port

    world, num_ps = JOBS[strategy] if when == "epoch" else (2, 0)
    port = free_port()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(chief_result_job.PRELOAD)  # torch imported once, not once per rank
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TMPDIR": str(tmp_path), "TOWERS_STRATEGY": strategy, "TOWERS_NUM_PS": str(num_ps)}
        for key in [k for k in os.environ if k.startswith(("TOWERS_", "TORCHELASTIC_", "TF_CONFIG", "SLURM_"))]:
            env.setdefault(key, "")  # the stuck-job bound and the rest at their defaults
        p = ctx.Process(target=chief_result_job.run_rank, daemon=True,
                        args=(env, str(tmp_path / f"out{rank}"), str(tmp_path / f"err{rank}"), when))
        p.start()
        procs.append(p)
    exited_at: dict[int, float] = {}
    try:
        exited_at = wait_for_exits(procs, deadline_s=DEADLINE_S)
    finally:
        left = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return {"codes": [p.exitcode for p in procs], "exited_at": exited_at, "left": left,
            "out": [(tmp_path / f"out{r}").read_text() for r in range(world)],
            "err": [(tmp_path / f"err{r}").read_text() for r in range(world)]}


@pytest.mark.parametrize("strategy", list(JOBS))
def test_result_on_the_chief_only_ends_every_rank_with_the_error_and_the_fix(tmp_path, strategy):
    job = _run_job(tmp_path, strategy)
    world = len(job["codes"])
    logs = "\n".join(f"--- rank {r} stdout:\n{o}\nstderr:\n{e}" for r, (o, e) in enumerate(zip(job["out"], job["err"])))
    assert job["left"] == [], f"ranks still running after {DEADLINE_S:g} s: {job['left']}\n{logs}"
    assert all(code not in (0, 124) for code in job["codes"]), f"exit codes {job['codes']}\n{logs}"
    called_at = float(next(line for line in job["out"][0].splitlines() if line.startswith("CALL")).split()[1])
    took = {r: round(t - called_at, 1) for r, t in sorted(job["exited_at"].items())}
    print(f"{strategy}: every rank exited within {max(took.values()):.1f} s of result() ({took})")
    assert max(took.values()) < BOUND_S, f"{took}\n{logs}"
    assert all("DONE" not in out and "accuracy" not in out for out in job["out"]), logs  # nothing went on
    for rank, err in enumerate(job["err"]):
        assert "PartialCollectiveError: " in err, f"rank {rank}\n{logs}"
        assert "Metric.result() of 'sparse_categorical_accuracy' was called on rank 0" in err, f"rank {rank}\n{logs}"
        assert "Call result() on every replica and print on the chief" in err, f"rank {rank}\n{logs}"
        assert "the job is stuck" not in err, f"rank {rank}\n{logs}"
    workers = world - JOBS[strategy][1]
    for rank in range(1, workers):  # each replica that did not call it says so, and where it waited instead
        assert f"but not on rank {rank} (this rank), which went on and waits" in job["err"][rank], logs
    assert f"but not on rank{'s' if workers > 2 else ''} {', '.join(map(str, range(1, workers)))}" in job["err"][0], logs



def test_result_on_the_chief_only_after_the_loop_ends_the_chief_with_the_error(tmp_path):
    """The chief calls result() alone after the loop, while the other replica's script ends."""
    job = _run_job(tmp_path, "mirrored", when="end")
    logs = "\n".join(f"--- rank {r} stdout:\n{o}\nstderr:\n{e}" for r, (o, e) in enumerate(zip(job["out"], job["err"])))
    assert job["left"] == [] and job["codes"][1] == 0 and "DONE" in job["out"][1], logs  # its script ended
    assert job["codes"][0] not in (0, 124), f"exit codes {job['codes']}\n{logs}"
    called_at = float(next(line for line in job["out"][0].splitlines() if line.startswith("CALL")).split()[1])
    took = job["exited_at"][0] - called_at
    print(f"mirrored, after the loop: the chief exited {took:.1f} s after result()")
    assert took < BOUND_S, logs
    assert ("PartialCollectiveError: [rank 0/2] Metric.result() of 'sparse_categorical_accuracy' was called on rank 0 "
            "(which waited") in job["err"][0], logs
    assert "but not on rank 1, which went on and ended (its script finished or failed) without calling it" in \
        job["err"][0], logs
    assert "Call result() on every replica and print on the chief" in job["err"][0], logs


def test_result_on_the_chief_only_ends_every_fault_tolerant_group_with_the_error(tmp_path):
    """Two replica groups under towers launch: the chief's group waits in result(), the other begins its next step."""
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    argv = [*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "fault_tolerant",
            chief_result_job.__file__, "epoch", str(tmp_path)]  # the last argument marks the job's processes
    env = clean_env()
    env.pop("RUST_LOG", None)
    launcher = OutputReader(start(argv, cwd=tmp_path, env=env))
    try:
        launcher.proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pass  # told below, with the job's output
    finally:
        ended_at = time.time()  # torchrun's agent returns once every group's processes exited
        running = launcher.proc.poll() is None
        if running:
            os.killpg(launcher.proc.pid, signal.SIGKILL)
        leftovers = processes_running(str(tmp_path))
        kill(leftovers)
    out, err = launcher.collect(timeout_s=10)
    logs = f"stdout:\n{out}\nstderr:\n{err[-8000:]}"
    assert not running, f"towers launch still running after {DEADLINE_S:g} s\n{logs}"
    assert leftovers == [], f"processes left behind: {leftovers}\n{logs}"
    assert launcher.proc.returncode not in (0, 124), f"towers launch exited {launcher.proc.returncode}\n{logs}"
    called_at = float(next(line for line in out.splitlines() if line.startswith("[rank 0]: CALL")).split()[-1])
    print(f"fault_tolerant: every process exited within {ended_at - called_at:.1f} s of result()")
    assert ended_at - called_at < BOUND_S, logs
    assert "DONE" not in out and "accuracy" not in out, logs  # nothing went on
    for group in (0, 1):
        said = "\n".join(line for line in err.splitlines() if line.startswith(f"[rank {group}]: "))
        assert "PartialCollectiveError: " in said, f"group {group}\n{logs}"
        assert "Metric.result() of 'sparse_categorical_accuracy' was called on rank 0" in said, f"group {group}\n{logs}"
        assert "Call result() on every replica and print on the chief" in said, f"group {group}\n{logs}"
    # The group that exits first ends the job; its supervisor says so (torchrun may stop the other before its own line).
    assert re.search(r"replica group [01] exited with code 1 on an error of the whole job", err), logs
    assert "but not on rank 1 (this rank), which went on and began the job's next step" in err, logs
    assert "restarting" not in err and "restarted alone" not in err and "Timed out" not in err, logs
