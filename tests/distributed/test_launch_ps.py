"""`towers launch --strategy ps` with a dead non-chief worker: both modes finish without it.

The real command in a new session with a deadline (the process group is killed on timeout), and
no process left behind. One job of 1 ps task + 2 workers; worker rank 1 exits with code 3 after
``VICTIM_STEPS`` pushes (``os._exit``, no goodbye). Under every rank runs the supervisor
(``towers.launch.supervise``), which hides that worker's failure from torchrun's agent.

A worker SIGKILLed during start-up (after its rendezvous record, before torch's process group; or
after the group, before its ps links) is not hidden: the job fails at once, naming it.
"""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest
from cli_support import run, towers_command

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 90.0
STEPS = 40
VICTIM_STEPS = 3

SCRIPT = f"""
    import os, sys, time
    import torch
    import torch.nn.functional as F
    from torch import nn
    import towers

    MODE, STEPS, VICTIM_STEPS = sys.argv[1], {STEPS}, {VICTIM_STEPS}

    strategy = towers.strategy_from_env(mode=MODE, timeout_s=30)  # the ps task serves here, then exits 0
    rank = strategy.process_info.rank
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    net, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    steps = 0
    for step in range(STEPS):
        if rank == 1 and step == VICTIM_STEPS:
            print(f"worker rank 1 dies at {{time.time()}}", flush=True)
            os._exit(3)
        if rank == 0 and step == 10:  # async: make sure the death happens while the chief still trains
            deadline = time.monotonic() + 30
            while not strategy.ps_stats()[0]["dead"] and time.monotonic() < deadline:
                time.sleep(0.05)
        x = torch.randn(8, 4, generator=g)
        y = (x[:, 0] > 0).long()
        towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"), global_batch_size=16).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    if strategy.is_chief:
        stats = strategy.ps_stats()[0]
        print(f"chief finished steps={{steps}} applied={{stats['worker_versions']}} version={{stats['version']}} "
              f"dead={{sorted(stats['dead'])}}", flush=True)
    strategy.shutdown()
"""


def run_ps_launch(tmp_path: Path, mode: str) -> tuple[int, str, str, float]:
    """Run the ps job in ``mode``; return (exit code, stdout, stderr, end time). Fails the test on the deadline."""
    script = tmp_path / f"ps_job_{mode}.py"
    script.write_text(textwrap.dedent(SCRIPT))
    command = [*towers_command(), "launch", "--strategy", "ps", "--num-ps", "1", "--nproc-per-node", "3",
               "--monitor-interval", "0.2", str(script), mode]
    result = run(command, cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    return result.returncode, result.stdout, result.stderr, time.time()


def test_async_job_finishes_without_a_dead_worker(tmp_path):
    code, out, err, _ = run_ps_launch(tmp_path, "async")
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "worker rank 1 dies at" in out, out
    # the supervisor's line when it happens, and the launcher's summary at the end
    assert "towers: worker rank 1 exited with code 3; the parameter-server job continues without it" in err, err
    assert re.search(r"WARNING towers\.launch\.launcher: worker rank 1 \(local rank 1\) exited with code 3 during "
                     r"the job; the parameter-server job finished without it", err), err
    # the chief logged it and trained to the end; the ps applied every push of both workers, once
    assert "worker 1 (rank 1) is gone" in err and "the other workers go on" in err, err
    expected = f"chief finished steps={STEPS} applied=[{STEPS}, {VICTIM_STEPS}] version={STEPS + VICTIM_STEPS} dead=[1]"
    assert expected in out, f"missing {expected!r} in:\n{out}\nstderr:\n{err}"


def test_sync_job_finishes_without_a_dead_worker(tmp_path):
    code, out, err, _ = run_ps_launch(tmp_path, "sync")
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "worker rank 1 dies at" in out, out
    assert "worker 1 (rank 1) is gone" in err and "the other workers go on" in err, err
    # rounds with both workers until the death, then the chief's pushes alone: one update per round
    expected = f"chief finished steps={STEPS} applied=[{STEPS}, {VICTIM_STEPS}] version={STEPS} dead=[1]"
    assert expected in out, f"missing {expected!r} in:\n{out}\nstderr:\n{err}"


# A worker that dies during start-up: the job cannot start without it, so it must fail at once, naming it.
STARTUP_SCRIPT = """
    import os, signal, sys, time
    import torch.distributed as dist
    import towers
    from towers.strategies.parameter_server import transport

    POINT = sys.argv[1]
    rank = int(os.environ["RANK"])

    def dies_first(original):
        def call(*args, **kwargs):
            print(f"worker rank 1 dies at {POINT} at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return call if rank == 1 else original

    # after its rendezvous record, before torch's process group; or after the group, before its ps links
    if POINT == "init_process_group":
        dist.init_process_group = dies_first(dist.init_process_group)
    else:
        transport.open_link = dies_first(transport.open_link)
    strategy = towers.strategy_from_env(timeout_s=300)  # the default timeouts: the death must not wait them out
    print(f"rank {rank} started", flush=True)
    strategy.shutdown()
"""
STARTUP_BOUND_S = 30.0


@pytest.mark.parametrize("point", ["init_process_group", "open_link"])
def test_a_worker_dead_in_start_up_fails_the_job_at_once_naming_it(tmp_path, point):
    script = tmp_path / "ps_startup.py"
    script.write_text(textwrap.dedent(STARTUP_SCRIPT))
    command = [*towers_command(), "launch", "--strategy", "ps", "--num-ps", "1", "--nproc-per-node", "3",
               "--monitor-interval", "0.2", str(script), point]
    result = run(command, cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    ended, out, err = time.time(), result.stdout, result.stderr
    died = re.search(rf"worker rank 1 dies at {point} at ([0-9.]+)", out)
    assert died, f"stdout:\n{out}\nstderr:\n{err}"
    assert result.returncode != 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert ended - float(died.group(1)) < STARTUP_BOUND_S, f"the job took {ended - float(died.group(1)):.0f} s to fail"
    # the supervisor says the job cannot go on without it, and the launcher names it; nobody says it continues
    assert "continues without it" not in err and "finished without it" not in err, err
    assert ("towers: worker rank 1 was killed by SIGKILL during start-up, before its links to the parameter servers "
            "were up; the parameter-server job cannot start without it") in err, err
    assert re.search(r"towers launch: rank 1 \(local rank 1, pid \d+\) was killed by SIGKILL", err), err
    # the ps task named it too, unless the launcher stopped it first (worker 0 may have finished its own start-up)
    assert re.search(r"\[rank 2/3\] ERROR towers\.process_group: rank 1 died during start-up \(its process, pid \d+ "
                     r"on host \S+, is gone\) while this process was (creating the process group|connecting worker 1)",
                     err) or "rank 2 was killed by SIGTERM" in err, err
