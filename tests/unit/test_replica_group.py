"""One replica group of a fault-tolerant job (``towers.launch.replica_group``), on tiny Python children (no torch).

Each child prints its member environment; the tests check that a failed member restarts the whole
group (and only up to ``--restarts`` times), that a stopped member is named, killed and restarted,
that a group of several processes gets ranks counted in processes, and that after a group ended the
job's training a failed group is not started again and a restarted one that joined no step is stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from towers.launch.replica_group import group_command, member_environment, read_restarts

# One write per line: a member killed right after it (its group restarting) cannot leave half a line that the next
# run's line then joins (print writes the text and the newline separately when Python runs unbuffered).
SHOW = ("import os; os.write(1, f\"run {os.environ['TOWERS_GROUP_RESTART']} member "
        "{os.environ['TOWERS_FT_GROUP_RANK']}\\n\".encode())\n")


def run_group(child_code: str, tmp_path, *, restarts: int, size: int = 1, stopped_kill_s: float = 15.0,
              env: dict[str, str] | None = None):
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **(env or {})}
    argv = [sys.executable, "-m", "towers.launch.replica_group", "--group-size", str(size), "--restarts", str(restarts),
            "--stopped-kill-s", str(stopped_kill_s), "--report-dir", str(tmp_path), "--", sys.executable, "-c",
            SHOW + child_code]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_member_environment_counts_processes_in_groups_of_several():
    torchrun = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "h"}
    env = member_environment(torchrun, group_size=2, member=1, port=1234, restart=2)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "6", "3", "6")
    assert (env["TOWERS_FT_GROUP"], env["TOWERS_FT_GROUP_RANK"], env["TOWERS_FT_GROUP_SIZE"]) == ("1", "1", "2")
    assert env["TOWERS_FT_GROUP_PORT"] == "1234" and env["TOWERS_GROUP_RESTART"] == "2" and env["MASTER_ADDR"] == "h"
    alone = member_environment(torchrun, group_size=1, member=0, port=1, restart=0)
    assert alone["RANK"] == "1" and alone["WORLD_SIZE"] == "3"  # one process per group: torchrun's numbering


def test_group_command_wraps_the_agents_entrypoint():
    python, args = group_command("/usr/bin/python3", ["-u", "train.py"], group_size=2, restarts=3, stopped_kill_s=5)
    assert python == sys.executable
    assert args == ["-u", "-m", "towers.launch.replica_group", "--group-size", "2", "--restarts", "3",
                    "--stopped-kill-s", "5", "--", "/usr/bin/python3", "-u", "train.py"]


def test_a_failed_member_restarts_the_whole_group_until_it_succeeds(tmp_path):
    # Member 1 fails on the group's first two starts; member 0 would run on forever, so it must be killed.
    child = ("import os, time\n"
             "n, m = int(os.environ['TOWERS_GROUP_RESTART']), int(os.environ['TOWERS_FT_GROUP_RANK'])\n"
             "if n < 2 and m == 1: raise SystemExit(5)\n"
             "if n < 2: time.sleep(60)\n")
    began = time.monotonic()
    proc = run_group(child, tmp_path, restarts=3, size=2)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - began < 30  # member 0 was killed at once, not waited for
    assert sorted(proc.stdout.split("\n")[:-1])[-2:] == ["run 2 member 0", "run 2 member 1"]
    assert "replica group 1 process 1 (pid" in proc.stderr
    assert "exited with code 5; restarting its 2 processes alone (restart 2 of 3)" in proc.stderr
    assert [r["restart"] for r in read_restarts(str(tmp_path))] == [1, 2]


def test_restarts_are_bounded_and_the_last_failure_is_the_exit(tmp_path):
    proc = run_group("raise SystemExit(7)", tmp_path, restarts=1)
    assert proc.returncode == 7
    assert proc.stdout.split("\n")[:-1] == ["run 0 member 0", "run 1 member 0"]
    assert "replica group 1 exited with code 7 after 1 restart(s) of the group, the most --group-restarts allows" \
        in proc.stderr


def test_a_stopped_member_is_named_then_killed_and_restarted(tmp_path):
    child = ("import os, signal\n"
             "if os.environ['TOWERS_GROUP_RESTART'] == '0': os.kill(os.getpid(), signal.SIGSTOP)\n"
             "print('ran again', flush=True)")
    proc = run_group(child, tmp_path, restarts=1, stopped_kill_s=0.5)
    assert proc.returncode == 0, proc.stderr
    assert "ran again" in proc.stdout
    assert "replica group 1 (pid" in proc.stderr and "is stopped (SIGSTOP): the other groups leave this group out" \
        in proc.stderr
    assert "stayed stopped for 0.5 s; killing it" in proc.stderr and "was killed by SIGKILL; restarting it alone" \
        in proc.stderr


# A child that notes, as the strategy and a supervisor would, that it joined the job or that the job ended.
NOTES = ("import os\n"
         "from towers.cluster.info import ProcessInfo\n"
         "from towers.launch.job_end import note_job_complete\n"
         "launch_dir = os.environ['TOWERS_LAUNCH_DIR']\n")


def test_a_group_that_ends_records_the_jobs_end_and_a_failure_after_it_is_not_restarted(tmp_path):
    from towers.launch.job_end import job_end_noted

    launch = tmp_path / "launch"
    launch.mkdir()
    env = {"TOWERS_LAUNCH_DIR": str(launch)}
    proc = run_group("", tmp_path, restarts=2, env=env)  # every member exited 0: the job's training ended
    assert proc.returncode == 0, proc.stderr
    ended = job_end_noted(str(launch))
    assert ended is not None and ended.group == 1
    proc = run_group("raise SystemExit(3)", tmp_path, restarts=2, env=env)  # another group, lost after the end
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["run 0 member 0"]  # not started again
    assert "replica group 1 found the job complete: replica group 1 ended the job's training" in proc.stderr, proc.stderr
    assert "and it (pid" in proc.stderr and "exited with code 3; it is not started again" in proc.stderr, proc.stderr


def test_a_restarted_group_that_has_not_joined_a_step_when_the_job_ends_is_stopped(tmp_path):
    launch = tmp_path / "launch"
    launch.mkdir()
    # Start 0 fails; start 1 waits for a quorum (never joins) when the other group ends the job: stopped, exit 0.
    child = NOTES + ("import time\n"
                     "if os.environ['TOWERS_GROUP_RESTART'] == '0': raise SystemExit(4)\n"
                     "note_job_complete(ProcessInfo(launch_dir=launch_dir), 0)\n"
                     "time.sleep(60)\n")
    began = time.monotonic()
    proc = run_group(child, tmp_path, restarts=3, env={"TOWERS_LAUNCH_DIR": str(launch)})
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - began < 30  # stopped at once, not after its sleep
    lines = [line for line in proc.stderr.splitlines() if "found the job complete" in line]
    assert len(lines) == 1 and "replica group 1 found the job complete: replica group 0 ended the job's training" \
        in lines[0] and "before this start of the group (restart 1) took part in a step; stopping it" in lines[0], \
        proc.stderr
    # One that joined a step (its strategy noted it) ends with the job instead, as its script does.
    joined = tmp_path / "joined"
    joined.mkdir()
    child = NOTES + ("import time\n"
                     "from towers.launch.job_end import JobEndView\n"
                     "if os.environ['TOWERS_GROUP_RESTART'] == '0': raise SystemExit(4)\n"
                     "JobEndView(ProcessInfo(launch_dir=launch_dir)).joined()\n"
                     "note_job_complete(ProcessInfo(launch_dir=launch_dir), 0)\n"
                     "time.sleep(1)  # its last step and saving its results, which the supervisor must not stop\n"
                     "print('ended with the job', flush=True)\n")
    proc = run_group(child, tmp_path, restarts=3, env={"TOWERS_LAUNCH_DIR": str(joined)})
    assert proc.returncode == 0 and "ended with the job" in proc.stdout, proc.stderr
    assert "found the job complete" not in proc.stderr, proc.stderr
