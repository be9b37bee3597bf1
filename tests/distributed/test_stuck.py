"""A stuck rank is named: every process exits within the watchdog's bound, with a report.

Four faults, injected into rank 1 under MirroredStrategy and under sync ParameterServerStrategy
(+1 ps): it stops (SIGSTOP) or loops forever (2 workers), skips a collective (the barrier at the
end of the first epoch) or runs one step more than the others (3 workers, so that the odd one out
can be named); see tests/stuck_job.py. The bound is ``TOWERS_STUCK_TIMEOUT_S=3``; the process-group timeout stays at
120 s, so only the watchdog can end the job in time. The ranks find their place torchrun-style
(``RANK``, ``MASTER_PORT``, ...); the test owns the deadline and SIGKILLs anything left over
(a stopped rank cannot exit by itself: under ``towers launch`` the launcher ends it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

import stuck_job

pytestmark = pytest.mark.timeout(90)

BOUND_S = 3.0
DEADLINE_S = 45.0


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(stuck_job.PRELOAD)  # torch imported once, not once per rank and job
    return ctx


def _run_job(tmp_path: Path, strategy: str, fault: str) -> dict:
    from multiprocessing.connection import wait

    from towers.launch.spawn import free_port

    # Two workers that wait in different places cannot tell which one is wrong (rank 1 skipped the
    # barrier = rank 0 entered one more): those faults run three, so the odd one out is named.
    workers = 3 if fault in ("skip", "extra_step") else 2
    world = workers + (1 if strategy == "ps" else 0)
    port = free_port()
    ctx = _context()
    procs: list[mp.process.BaseProcess] = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TMPDIR": str(tmp_path), "TOWERS_STUCK_TIMEOUT_S": str(BOUND_S)}
        for key in [k for k in os.environ if k.startswith(("TOWERS_", "TORCHELASTIC_", "TF_CONFIG", "SLURM_"))]:
            env.setdefault(key, "")
        p = ctx.Process(target=stuck_job.run_rank, args=(env, strategy, fault, str(tmp_path / f"out{rank}"),
                                                         str(tmp_path / f"err{rank}")), daemon=True)
        p.start()
        procs.append(p)
    exited_at: dict[int, float] = {}
    stopped: list[int] = []
    try:
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        deadline = time.monotonic() + DEADLINE_S
        while sentinels and time.monotonic() < deadline:
            for s in wait(list(sentinels), timeout=max(0.0, deadline - time.monotonic())):
                exited_at[sentinels.pop(s)] = time.time()
            # a stopped rank never exits by itself: once every other rank has, it is the only one left
            if fault == "stop" and list(sentinels.values()) == [1] and _state(procs[1].pid) == "T":
                stopped.append(1)
                break
    finally:
        left = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL also ends a stopped process
            p.join(10)
    return {"codes": [p.exitcode for p in procs], "exited_at": exited_at, "stopped": stopped, "left": left,
            "out": [(tmp_path / f"out{r}").read_text() for r in range(world)],
            "err": [(tmp_path / f"err{r}").read_text() for r in range(world)],
            "reports": sorted(tmp_path.glob("towers-stuck-*.txt"))}


def _state(pid: int | None) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def _section(report: str, rank: int) -> str:
    return report.split(f"--- rank {rank} ---\n", 1)[1].split("\n--- rank ", 1)[0]


@pytest.mark.parametrize("strategy", ["mirrored", "ps"])
@pytest.mark.parametrize("fault", stuck_job.FAULTS)
def test_a_stuck_rank_is_named_and_every_rank_exits(tmp_path, strategy, fault):
    job = _run_job(tmp_path, strategy, fault)
    world = len(job["codes"])
    logs = "\n".join(f"--- rank {r} stdout:\n{o}\nstderr:\n{e}" for r, (o, e) in enumerate(zip(job["out"], job["err"])))
    others = [r for r in range(world) if r not in job["stopped"]]
    assert sorted(job["exited_at"]) == others, f"ranks still running at the deadline: {job['left']}\n{logs}"
    assert [job["codes"][r] for r in others] == [124] * len(others), f"exit codes {job['codes']}\n{logs}"
    assert job["stopped"] == ([1] if fault == "stop" else []), logs
    assert all("DONE" not in out for out in job["out"]), logs
    fault_at = float(next(line for line in job["out"][1].splitlines() if line.startswith("FAULT")).split()[1])
    # the bound (3 s) and the answers (2 s), with room for a loaded 2-core machine
    assert max(job["exited_at"].values()) - fault_at < BOUND_S + 10, logs

    assert len(job["reports"]) == 1, f"{job['reports']}\n{logs}"
    report = job["reports"][0].read_text()
    assert report.startswith("towers: the job is stuck."), report
    assert "towers: the job is stuck." in job["err"][0], f"the chief's stderr lacks the report\n{logs}"
    assert f"past the bound of {BOUND_S:.1f} s = max({BOUND_S:g} s, 10 x the slowest recent step" in report, report
    # every rank's place: the collective (number, kind) or the towers call it is in or last finished
    where = report.split("Where each rank is:\n", 1)[1].split("Python stacks:", 1)[0]
    assert all(f"  rank {r} (" in where for r in range(world)), report
    assert where.count("#") >= (1 if fault == "stop" else 2), report  # a stopped rank's last heartbeat may predate it
    answered = [0] if fault == "stop" else [0, 1]
    if fault == "stop":
        assert "Stuck: rank 1.\n" in report, report
        assert "rank 1 did not answer: stopped or hung in C code" in report, report
        assert "(no stack: the rank did not answer: stopped or hung in C code)" in _section(report, 1), report
    elif fault == "loop":
        assert "Stuck: rank 1.\n" in report, report
        assert "rank 1 is not in any collective while rank(s) 0 wait" in report, report
        assert "_spin_forever" in _section(report, 1), report
    else:
        # ranks 0 and 2 wait in the barrier; rank 1 is elsewhere: it skipped the barrier, or ran one more step
        assert "Stuck: rank 1.\n" in report, report
        line = next(x for x in report.splitlines() if x.startswith("  rank 1 "))
        if strategy == "mirrored":  # in DDP's all-reduce of the next step, a collective the others never entered
            assert line.startswith("  rank 1 is ahead: it waits in collective #"), report
            assert "(all_reduce), which rank(s) 0, 2 never entered" in line, report
        else:  # in a push to the ps, at the point where the others wait in the barrier
            assert line.startswith("  rank 1 waits in towers call #"), report
            assert "ps push, a different collective from rank(s) 0, 2 at the same point" in line, report
        for r in (0, 2):
            assert "strategy.barrier" in next(x for x in where.splitlines() if x.startswith(f"  rank {r} (")), report
            assert "in barrier" in _section(report, r), report
        answered = [0, 1, 2]
    for r in answered:
        assert "Thread MainThread (most recent call last):" in _section(report, r), report
        assert "in _job" in _section(report, r), report
    if strategy == "ps":  # the ps task (the last rank) answered too
        assert f"  rank {world - 1} (ps," in where, report
        assert "in serve" in _section(report, world - 1), report
