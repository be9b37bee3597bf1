"""The ps supervisor (``towers.launch.supervise``): role -> exit decision, the wrapped command, the flag.

The decision is tested on ``ProcessInfo``s built from dicts; ``main`` runs on tiny Python children
(no torch, no process group) to check the exit codes, the report and signal forwarding.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from towers import cluster
from towers.launch.spec import LaunchSpec, parse_launch_args
from towers.launch.supervise import decide, read_reports, supervised_command


def ps_job_env(rank: int, world_size: int = 3, num_ps: int = 1) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
            "TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": str(num_ps)}


def info_of(rank: int, **kwargs) -> cluster.ProcessInfo:
    return cluster.from_env(ps_job_env(rank, **kwargs))


# --- decide: role -> exit code ----------------------------------------------------------------
def test_a_non_chief_worker_failure_is_tolerated():
    decision = decide(info_of(1), 3)
    assert decision.tolerated and decision.exit_code == 0 and decision.signal_number is None
    assert decision.message.startswith("towers: worker rank 1 exited with code 3; the parameter-server job "
                                       "continues without it (the others take over its batches)")


@pytest.mark.parametrize("rank, role", [(0, "the chief"), (2, "the ps task")])
def test_chief_and_ps_failures_propagate(rank, role):
    decision = decide(info_of(rank), 3)
    assert not decision.tolerated and decision.exit_code == 3, role


def test_signal_deaths_keep_their_signal_except_on_a_tolerated_worker():
    chief = decide(info_of(0), -signal.SIGKILL)
    assert chief.signal_number == signal.SIGKILL and chief.exit_code == 128 + signal.SIGKILL
    worker = decide(info_of(1), -signal.SIGKILL)
    assert worker.tolerated and worker.exit_code == 0 and "worker rank 1 was killed by SIGKILL" in worker.message


def test_a_worker_dead_in_start_up_stops_the_job_saying_it_cannot_start_without_it():
    decision = decide(info_of(1), -signal.SIGKILL, started=False)
    assert not decision.tolerated and decision.signal_number == signal.SIGKILL
    assert decision.message == ("towers: worker rank 1 was killed by SIGKILL during start-up, before its links to the "
                                "parameter servers were up; the parameter-server job cannot start without it and "
                                "stops")
    assert decide(info_of(0), 3, started=False).message == ""  # the chief's failure stops the job anyway


def test_success_a_stop_request_or_an_unknown_role_propagate():
    assert decide(info_of(1), 0).exit_code == 0 and not decide(info_of(1), 0).tolerated
    # the agent is stopping the job (it signalled the supervisor): report the child's status as is
    stopped = decide(info_of(1), -signal.SIGTERM, stop_requested=True)
    assert not stopped.tolerated and stopped.signal_number == signal.SIGTERM
    assert decide(None, 3).exit_code == 3


def test_roles_come_from_tf_config_too():
    tf_config = json.dumps({"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"], "ps": ["h3:1"]},
                            "task": {"type": "worker", "index": 0}})
    worker0 = cluster.from_env({"TF_CONFIG": tf_config})
    assert not worker0.is_chief and decide(worker0, 1).tolerated  # worker:0 is not the chief when one is listed
    chief = cluster.from_env({"TF_CONFIG": tf_config.replace('"type": "worker"', '"type": "chief"')})
    assert chief.is_chief and not decide(chief, 1).tolerated


# --- the wrapped command ------------------------------------------------------------------------
def test_supervised_command_wraps_the_agents_entrypoint():
    cmd, args = supervised_command("/usr/bin/python3", ["-u", "train.py", "--lr", "0.1"], report_dir="/tmp/r",
                                   python="/py")
    assert cmd == "/py"
    assert args == ["-u", "-m", "towers.launch.supervise", "--report-dir", "/tmp/r", "--", "/usr/bin/python3", "-u",
                    "train.py", "--lr", "0.1"]
    # --run-path: torchrun's entrypoint is a function running cmd_args[0]; the supervisor runs it with python -u
    _, args = supervised_command(lambda *a: None, ["train.py", "x"], python="/py")
    assert args == ["-u", "-m", "towers.launch.supervise", "--", "/py", "-u", "train.py", "x"]


# --- the flag -----------------------------------------------------------------------------------
def test_tolerating_worker_failures_is_the_default_for_ps_only():
    assert LaunchSpec(script="t.py", nproc_per_node=3, strategy="ps").tolerate_worker_failures is True
    assert LaunchSpec(script="t.py", nproc_per_node=2, strategy="mirrored").tolerate_worker_failures is False
    assert LaunchSpec(script="t.py", nproc_per_node=2).tolerate_worker_failures is False
    off = LaunchSpec(script="t.py", nproc_per_node=3, strategy="ps", tolerate_worker_failures=False)
    assert off.tolerate_worker_failures is False
    with pytest.raises(ValueError, match=r"--tolerate-worker-failures only applies to --strategy ps.*Received: "
                                         r"--strategy mirrored"):
        LaunchSpec(script="t.py", nproc_per_node=2, strategy="mirrored", tolerate_worker_failures=True)


def test_the_flag_parses():
    base = ["--nproc-per-node", "3", "--strategy", "ps", "train.py"]
    assert parse_launch_args(base, gpu_count=0, cpu_count=2).tolerate_worker_failures is True
    off = parse_launch_args(["--no-tolerate-worker-failures", *base], gpu_count=0, cpu_count=2)
    assert off.tolerate_worker_failures is False and "tolerate_worker_failures" not in off.torchrun_options


# --- main, on tiny children ---------------------------------------------------------------------
def run_supervisor(rank: int, child_code: str, tmp_path, *, extra_env: dict[str, str] | None = None,
                   **popen) -> subprocess.Popen:
    env = {**os.environ, **ps_job_env(rank), **(extra_env or {})}
    env.pop("TF_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "towers.launch.supervise", "--report-dir", str(tmp_path), "--",
                             sys.executable, "-c", child_code], env=env, stderr=subprocess.PIPE, text=True, **popen)


def test_main_tolerates_a_worker_and_reports_it(tmp_path):
    proc = run_supervisor(1, "raise SystemExit(3)", tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "towers: worker rank 1 exited with code 3; the parameter-server job continues without it" in err
    (report,) = read_reports(str(tmp_path))
    assert report["rank"] == 1 and report["returncode"] == 3 and report["description"] == "exited with code 3"


def test_main_propagates_the_chiefs_code_and_signal(tmp_path):
    proc = run_supervisor(0, "raise SystemExit(3)", tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "towers:" not in err, err
    proc = run_supervisor(0, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL  # as the agent would have seen without the supervisor
    assert read_reports(str(tmp_path)) == []


def test_main_forwards_sigterm_and_leaves_no_child(tmp_path):
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = run_supervisor(1, child, tmp_path, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    child_pid = int(pid_file.read_text())
    os.killpg(proc.pid, signal.SIGTERM)  # what torchrun's agent does to stop a worker
    _, err = proc.communicate(timeout=30)
    # a worker stopped by the agent is not a tolerated failure: the supervisor dies of the same signal
    assert proc.returncode == -signal.SIGTERM, err
    assert "continues without it" not in err and read_reports(str(tmp_path)) == []
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


def test_main_tolerates_a_worker_only_after_its_start_up_and_publishes_an_earlier_death(tmp_path):
    import torch.distributed as dist

    from towers.cluster.deaths import read_deaths

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the job's store (the agent's)
    notes = tmp_path / "notes"
    notes.mkdir()
    job = {"TOWERS_LAUNCH_DIR": str(notes), "MASTER_PORT": str(server.port)}
    started = ("from towers.cluster.launch_notes import note_started; "
               f"note_started({str(notes)!r}, rank=1); raise SystemExit(3)")
    proc = run_supervisor(1, started, tmp_path, extra_env=job)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "continues without it" in err, err
    store = dist.PrefixStore("towers/attempt_0", server)
    assert read_deaths(store, 3) == {}

    proc = run_supervisor(1, "raise SystemExit(3)", tmp_path, extra_env=job)  # no note: it died in start-up
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "towers: worker rank 1 exited with code 3 during start-up" in err and "continues" not in err, err
    assert read_deaths(store, 3) == {1: "exited with code 3"}  # the others, on every node, stop naming it


def test_main_without_a_command_says_how_to_use_it():
    proc = subprocess.run([sys.executable, "-m", "towers.launch.supervise"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "needs a command after `--`" in proc.stderr



def test_a_failed_node_tells_the_other_nodes_in_start_up_through_the_jobs_store():
    import types

    import torch.distributed as dist

    from towers.cluster.deaths import read_deaths
    from towers.launch import launcher

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # node 0's store
    spec = parse_launch_args(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr",
                              "127.0.0.1", "--master-port", str(server.port), "train.py"], gpu_count=0, cpu_count=2)
    failure = types.SimpleNamespace(exitcode=-signal.SIGKILL, local_rank=0, pid=1)
    launcher._announce_first_failure(types.SimpleNamespace(failures={1: failure}), spec)
    assert read_deaths(dist.PrefixStore("towers/attempt_0", server), 2) == {1: "was killed by SIGKILL"}
