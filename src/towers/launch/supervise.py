"""Run one worker's command under a supervisor so that a dead non-chief worker does not end a ps job.

torchrun's elastic agent has gang semantics: as soon as one of its processes exits non-zero it
stops all the others (and restarts the group when ``--max-restarts`` allows). In
``--strategy ps`` that is wrong for a non-chief worker: the ps tasks notice it is gone and the
others train on, taking over its batches. So ``towers launch --strategy ps`` starts every process as

    python -u -m towers.launch.supervise [--report-dir DIR] -- <the worker's command>

which runs the real command as its child (same environment: torchrun's variables pass through),
forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 to it, waits, and then decides
(``decide``) from this rank's role, read through ``towers.cluster``:

- the child succeeded, or the supervisor itself was signalled (the agent is stopping the job, or
  a preemption notice reached the launcher), or the child saved on a preemption notice and asks
  for a restart (``PREEMPTED_EXIT_CODE``, 75): exit as the child did, so the agent restarts the job;
- a non-chief worker failed after its start-up (it noted its links to the ps tasks up in the
  launch directory, ``towers.cluster.launch_notes``): print one line on stderr naming the rank and
  code, leave a report for the launcher in ``--report-dir``, and exit 0, so the agent lets the job go on;
- any process failed before its start-up finished: the job cannot start without it. Print one
  line saying so, publish the death in the job's store (``towers.cluster.deaths``: the processes
  of the other nodes waiting for it stop at once, naming it) and exit as the child did;
- the chief or a ps task failed (or the role is unknown): exit as the child did (a signal death
  is re-raised on the supervisor), so the agent stops the job and the launcher names the rank.

On Linux the child leads its own process group and dies with the supervisor
(``PR_SET_PDEATHSIG``), as under ``dumb-init``/``tini -p``: the agent's ``killpg`` reaches the
supervisor, which forwards the signal to the child's group exactly once, and the agent's SIGKILL
of the supervisor (after its ``shutdown_timeout``) takes the child with it. The supervisor never
ends its child itself: a ps task that receives a preemption notice keeps serving while the workers
save through it (``towers.checkpoint.preemption``), then exits with the restart code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from towers.cluster.info import ProcessInfo
from towers.cluster.launch_notes import started_pid
from towers.launch.exits import PREEMPTED_EXIT_CODE, describe_exit

__all__ = ["FORWARDED_SIGNALS", "Decision", "decide", "supervised_command", "read_reports", "child_setup",
           "send_signal", "main"]

#: Signals the supervisor passes on to its child (the ones torchrun's agent stops its workers with, and SLURM's).
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                                             "SIGUSR2") if hasattr(signal, name))

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Decision:
    """What the supervisor does once its child exited.

    ``exit_code`` is the supervisor's exit code; ``signal_number`` (when set) is re-raised on the
    supervisor instead, so the agent sees the same "killed by signal" as without a supervisor.
    ``message`` is the stderr line for a tolerated failure (``tolerated`` is then True).
    """

    exit_code: int
    signal_number: int | None = None
    tolerated: bool = False
    message: str = ""


def _propagate(returncode: int) -> Decision:
    if returncode < 0:
        return Decision(exit_code=128 + (-returncode), signal_number=-returncode)
    return Decision(exit_code=returncode)


def decide(info: ProcessInfo | None, returncode: int, *, stop_requested: bool = False,
           started: bool = True) -> Decision:
    """Return what to do after the child exited with ``returncode`` (negative: killed by that signal).

    A failure is tolerated only on a non-chief worker (``info.task.type == "worker"``, not the
    chief) that finished its start-up (``started``: its links to the ps tasks were up), and only
    when the supervisor was not itself told to stop; ``info=None`` (the role could not be read)
    tolerates nothing. A worker that died in start-up is not tolerated, with a ``message`` saying why.
    ``PREEMPTED_EXIT_CODE`` is no failure to hide: the worker saved with the others on a preemption
    notice, and the job stops to be restarted.
    """
    if returncode in (0, PREEMPTED_EXIT_CODE) or stop_requested or info is None:
        return _propagate(returncode)
    if info.task.type != "worker" or info.is_chief:
        return _propagate(returncode)
    if not started:
        failed = _propagate(returncode)
        return Decision(exit_code=failed.exit_code, signal_number=failed.signal_number, message=(
            f"towers: worker rank {info.rank} {describe_exit(returncode)} during start-up, before its links to "
            "the parameter servers were up; the parameter-server job cannot start without it and stops"))
    message = (f"towers: worker rank {info.rank} {describe_exit(returncode)}; the parameter-server job continues "
               "without it (the others take over its batches)")
    return Decision(exit_code=0, tolerated=True, message=message)


def supervised_command(cmd: str | Callable[..., Any], cmd_args: Sequence[str], *,
                       report_dir: str | None = None, python: str | None = None) -> tuple[str, list[str]]:
    """Return the agent's ``(entrypoint, args)`` that run ``cmd cmd_args`` under this supervisor.

    ``cmd`` is what ``torch.distributed.run.config_from_args`` returned: an executable, or (for
    ``--run-path``) a function that runs ``cmd_args[0]`` as a script, which becomes ``python -u``.
    """
    python = python or sys.executable
    child = [cmd, *cmd_args] if isinstance(cmd, str) else [python, "-u", *cmd_args]
    head = ["-u", "-m", "towers.launch.supervise"]
    if report_dir is not None:
        head += ["--report-dir", report_dir]
    return python, [*head, "--", *(str(part) for part in child)]


def read_reports(report_dir: str, *, prefix: str = "rank") -> list[dict[str, Any]]:
    """Return the reports whose file names start with ``prefix`` in ``report_dir``, by rank (unreadable ones skipped):
    by default the tolerated failures the supervisors wrote."""
    reports = []
    try:
        names = sorted(os.listdir(report_dir))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".json") or not name.startswith(prefix):
            continue
        try:
            with open(os.path.join(report_dir, name), encoding="utf-8") as fh:
                reports.append(json.load(fh))
        except (OSError, ValueError):
            continue
    return sorted(reports, key=lambda r: (r.get("rank", 0), r.get("pid", 0)))


def write_report(report_dir: str, name: str, record: dict[str, Any]) -> None:
    """Write ``record`` as ``report_dir/name.json`` for the launcher, atomically (it never reads half a report)."""
    path = os.path.join(report_dir, f"{name}.json")
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the stderr line has already said it; the launcher's summary is a convenience


def _write_report(report_dir: str, info: ProcessInfo, returncode: int) -> None:
    # The pid keeps the reports of a rank apart across restarts.
    write_report(report_dir, f"rank{info.rank}-pid{os.getpid()}",
                 {"rank": info.rank, "local_rank": info.local_rank, "returncode": returncode,
                  "description": describe_exit(returncode), "pid": os.getpid()})


def child_setup(parent_pid: int) -> Callable[[], None]:
    """Return the child's pre-exec step: its own process group, and SIGKILL when the supervisor dies (Linux)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the child only calls it
    except (OSError, AttributeError):
        prctl = None

    def preexec() -> None:  # runs in the child between fork and exec: keep it minimal
        os.setpgid(0, 0)  # a killpg of the supervisor's group then reaches the child once, through us
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
                os._exit(128 + int(signal.SIGKILL))

    return preexec


def send_signal(pid: int, signum: int, *, group: bool) -> None:
    """Send ``signum`` to the child ``pid``, to its whole process group when ``group`` (nothing if it is gone)."""
    # On Linux the child leads its own process group: signal the group, as the agent's killpg would have.
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _process_info() -> ProcessInfo | None:
    from towers import cluster

    try:
        return cluster.from_env()
    except ValueError as exc:  # ClusterConfigError: the child will say so too; tolerate nothing
        print(f"towers: the supervisor cannot tell this process's role ({exc}); a failure of it stops the job",
              file=sys.stderr, flush=True)
        return None


def _announce_death(info: ProcessInfo, returncode: int) -> None:
    # The others of this node see the pid gone; those of other nodes read this key (towers.cluster.deaths).
    try:
        from towers.process_group import announce_death  # torch: imported only when a child died in start-up

        announce_death(info, describe_exit(returncode))
    except Exception as exc:  # noqa: BLE001 - the store may be gone with the job; the exit status still tells
        print(f"towers: could not tell the other processes that rank {info.rank} died ({exc})", file=sys.stderr,
              flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m towers.launch.supervise",
        description="Run COMMAND; exit 0 when a non-chief parameter-server worker fails (towers launch --strategy ps).")
    parser.add_argument("--report-dir", default=None, help="directory for the launcher's report of tolerated failures")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command after ``--`` and return the supervisor's exit code (see the module docstring)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("towers: supervise needs a command after `--`. Usage: python -m towers.launch.supervise -- python -u "
              "train.py", file=sys.stderr)
        return 2
    info = _process_info()

    received: list[int] = []
    forwarded: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        if child is not None and child.returncode is None:  # returncode is set once wait() reaped it
            forwarded.append(signum)
            send_signal(child.pid, signum, group=linux)
            send_signal(child.pid, signal.SIGCONT, group=linux)  # a stopped child acts on it now, not at the agent's SIGKILL

    linux = sys.platform.startswith("linux")
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        child = subprocess.Popen(command, preexec_fn=child_setup(os.getpid()) if linux else None)
    except OSError as exc:
        print(f"towers: cannot start {command[0]!r}: {exc}. Check the command.", file=sys.stderr, flush=True)
        return 127
    if received and not forwarded:  # a signal came before the child existed: pass it on now
        send_signal(child.pid, received[-1], group=linux)
    returncode = child.wait()

    # Without a launch directory (not started by towers launch) nothing tells start-up apart: as before, tolerate.
    started = info is None or not info.launch_dir or started_pid(info.launch_dir, info.rank) == child.pid
    decision = decide(info, returncode, stop_requested=bool(received), started=started)
    if decision.message:
        print(decision.message, file=sys.stderr, flush=True)
    if decision.tolerated and info is not None and args.report_dir:
        _write_report(args.report_dir, info, returncode)
    if info is not None and returncode not in (0, PREEMPTED_EXIT_CODE) and not received and not started:
        _announce_death(info, returncode)
    if decision.signal_number is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(decision.signal_number, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
            pass
        os.kill(os.getpid(), decision.signal_number)
    return decision.exit_code


if __name__ == "__main__":
    sys.exit(main())
