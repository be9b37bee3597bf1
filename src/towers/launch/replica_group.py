"""Run one replica group of a fault-tolerant job: its processes, restarted together when one is lost.

``towers launch --strategy fault_tolerant`` starts one of these per replica group (torchrun's agent
sees one process per group):

    python -u -m towers.launch.replica_group --group-size N --restarts R [--stopped-kill-s S]
        [--report-dir DIR] -- <the worker's command>

It starts the command N times, one process per member of the group, and waits for them:

- every member exited 0: exit 0;
- a member failed (an exit code other than 0, or a signal): the group is broken (its members share
  process groups), so the other members are killed at once, and the whole group is started again
  (``TOWERS_GROUP_RESTART`` = 1, 2, ... in the new processes), up to R times, while the other
  groups train on; the new group heals from them. After R restarts the failure is the group's
  exit, and torchrun's agent stops the job;
- a member is *stopped* (SIGSTOP, SIGTSTP): said at once on stderr; still stopped after S seconds,
  it is killed, which restarts the group as above (continued before that, it goes on);
- this process is signalled (the agent stopping the job): the signal goes to every member and the
  group exits as they do, never restarted.

When every member exited 0 the group ran the script to its end, and the job's training ended with it
(the live groups step together): the supervisor records that (``towers.launch.job_end``). A group
that fails after that is not started again, and one started again that has not joined a step when
the record comes is stopped: either way the supervisor says in one line that the group found the job
complete, and exits 0, instead of a group waiting for a quorum that cannot come. A member that ended
with an error every group shares (a collective not every group called) notes it first: the group is not
started again, and its exit code is the job's.

Each member gets ``TOWERS_FT_GROUP`` (the group id: torchrun's ``RANK`` of this process),
``TOWERS_FT_GROUP_RANK``, ``TOWERS_FT_GROUP_SIZE`` and ``TOWERS_FT_GROUP_PORT`` (a free port, new for
every start, where member 0 serves the group's store). With N > 1, torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are rewritten to count processes rather than
groups (group g's member r is rank g * N + r). Members die with this process (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from towers.cluster.info import ProcessInfo
from towers.launch.exits import describe_exit
from towers.launch.job_end import JobEnd, job_end_noted, job_failure_noted, joined_noted, note_job_complete
from towers.launch.spawn import free_port
from towers.launch.supervise import FORWARDED_SIGNALS, child_setup, read_reports, send_signal, write_report

__all__ = ["group_command", "member_environment", "read_restarts", "main"]

_POLL_S = 0.1


def group_command(cmd: str | Callable[..., Any], cmd_args: Sequence[str], *, group_size: int, restarts: int,
                  stopped_kill_s: float, report_dir: str | None = None,
                  python: str | None = None) -> tuple[str, list[str]]:
    """Return the agent's ``(entrypoint, args)`` that run ``cmd cmd_args`` as one replica group of ``group_size``."""
    python = python or sys.executable
    child = [cmd, *cmd_args] if isinstance(cmd, str) else [python, "-u", *cmd_args]
    head = ["-u", "-m", "towers.launch.replica_group", "--group-size", str(int(group_size)), "--restarts",
            str(int(restarts)), "--stopped-kill-s", f"{float(stopped_kill_s):g}"]
    if report_dir is not None:
        head += ["--report-dir", report_dir]
    return python, [*head, "--", *(str(part) for part in child)]


def member_environment(environ: Mapping[str, str], *, group_size: int, member: int, port: int,
                       restart: int) -> dict[str, str]:
    """Return the environment of member ``member`` of the group this process runs (see the module docstring)."""
    env = dict(environ)
    group = int(environ.get("RANK", "0"))
    env.update(TOWERS_FT_GROUP=str(group), TOWERS_FT_GROUP_RANK=str(member), TOWERS_FT_GROUP_SIZE=str(group_size),
               TOWERS_FT_GROUP_PORT=str(port), TOWERS_GROUP_RESTART=str(restart))
    if group_size > 1:
        for key, index in (("RANK", group), ("LOCAL_RANK", int(environ.get("LOCAL_RANK", "0")))):
            env[key] = str(index * group_size + member)
        for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            env[key] = str(int(environ.get(key, "1")) * group_size)
    return env


def read_restarts(report_dir: str) -> list[dict[str, Any]]:
    """Return the restarts of replica groups written to ``report_dir``, by group."""
    return read_reports(report_dir, prefix="restart")


class _Group:
    """The members of one start of the group, and how they are doing."""

    def __init__(self, command: list[str], size: int, restart: int, *, linux: bool) -> None:
        port = free_port("127.0.0.1")
        self.linux = linux
        self.members = [subprocess.Popen(command, env=member_environment(os.environ, group_size=size, member=m,
                                                                          port=port, restart=restart),
                                         preexec_fn=child_setup(os.getpid()) if linux else None)
                        for m in range(size)]
        self.codes: dict[int, int] = {}
        self.stopped_at: dict[int, float] = {}

    def name(self, who: str, index: int) -> str:
        """How a member is named in messages: the group alone when it is the only one."""
        return who if len(self.members) == 1 else f"{who} process {index}"

    def signal_all(self, signum: int) -> None:
        for member in self.members:
            if member.returncode is None:
                send_signal(member.pid, signum, group=self.linux)

    def poll(self, who: str, stopped_kill_s: float) -> None:
        """Reap what ended; name and time what stopped; kill what stayed stopped too long."""
        for index, member in enumerate(self.members):
            if member.returncode is not None:
                continue
            pid, status = os.waitpid(member.pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            if pid == 0:
                since = self.stopped_at.get(index)
                if since is not None and time.monotonic() - since > stopped_kill_s:
                    print(f"towers: {self.name(who, index)} (pid {member.pid}) stayed stopped for {stopped_kill_s:g} s; "
                          "killing it, so that the group is restarted and heals", file=sys.stderr, flush=True)
                    send_signal(member.pid, signal.SIGKILL, group=self.linux)
                    del self.stopped_at[index]
            elif os.WIFSTOPPED(status):
                self.stopped_at[index] = time.monotonic()
                print(f"towers: {self.name(who, index)} (pid {member.pid}) is stopped "
                      f"({signal.Signals(os.WSTOPSIG(status)).name}): the other groups leave this group out of their "
                      f"quorum and train on; it is killed and restarted if still stopped in {stopped_kill_s:g} s",
                      file=sys.stderr, flush=True)
            elif os.WIFCONTINUED(status):
                self.stopped_at.pop(index, None)
                print(f"towers: {self.name(who, index)} (pid {member.pid}) was continued; the group rejoins the quorum "
                      "and heals from the others", file=sys.stderr, flush=True)
            else:
                member.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                self.codes[index] = member.returncode

    def failure(self) -> tuple[int, int] | None:
        """``(member, exit code)`` of the first member that failed, or None."""
        return next(((m, c) for m, c in sorted(self.codes.items()) if c != 0), None)

    def done(self) -> bool:
        return len(self.codes) == len(self.members)

    def kill(self) -> None:
        """SIGKILL every member still running (and continue a stopped one, so it dies now) and reap them."""
        self.signal_all(signal.SIGKILL)
        for index, member in enumerate(self.members):
            if member.returncode is None:
                self.codes.setdefault(index, member.wait())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m towers.launch.replica_group",
                                     description="Run COMMAND as the N processes of one replica group; restart them "
                                                 "together when one fails (towers launch --strategy fault_tolerant).")
    parser.add_argument("--group-size", type=int, default=1, help="processes of the group (default 1)")
    parser.add_argument("--restarts", type=int, default=0, help="how many times the group is restarted (default 0)")
    parser.add_argument("--stopped-kill-s", type=float, default=15.0,
                        help="kill (and so restart) a member left stopped this long (seconds, default 15)")
    parser.add_argument("--report-dir", default=None, help="directory for the launcher's report of restarts")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    return parser


class _JobEnd:
    """The job's end as this supervisor sees it (``towers.launch.job_end``): noted when its group ends the training,
    read before the group is started again and while a group started again has not joined a step."""

    def __init__(self, who: str) -> None:
        from towers.cluster import from_env

        self.who = who
        try:
            self.info: ProcessInfo | None = from_env()
        except ValueError:  # not torchrun's environment (a supervisor run by hand): no record
            self.info = None
        self.launch_dir = self.info.launch_dir if self.info is not None else None

    def note(self) -> None:
        """Record that this group ended the job's training (its processes all exited 0)."""
        if self.info is None:
            return
        try:
            note_job_complete(self.info, int(os.environ.get("RANK", "0")))
        except (OSError, RuntimeError) as exc:  # the directory or the store is gone (the job is being stopped)
            print(f"towers: {self.who} ended the job's training but could not record it ({type(exc).__name__}: {exc}); "
                  "a group started again now waits quorum_timeout_s for a quorum, then fails", file=sys.stderr,
                  flush=True)

    def ended(self) -> JobEnd | None:
        return job_end_noted(self.launch_dir)

    def failed(self) -> str | None:
        """The error a member noted as the job's failure before it ended (``JobEndView.failed``), or None."""
        return job_failure_noted(self.launch_dir, self.info.restart_count if self.info is not None else 0)

    def before_joining(self, group: _Group, restart: int) -> JobEnd | None:
        """The job's end, when it came before this start of the group (a restart) joined a step; else None."""
        if restart == 0 or any(joined_noted(self.launch_dir, m.pid) for m in group.members):
            return None
        return self.ended()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the group; return its exit code (a member's signal death is re-raised on this process instead)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.group_size < 1 or args.restarts < 0:
        print("towers: replica_group needs --group-size >= 1, --restarts >= 0 and a command after `--`. Usage: "
              "python -m towers.launch.replica_group --group-size 2 -- python -u train.py", file=sys.stderr)
        return 2
    linux = sys.platform.startswith("linux")
    who = f"replica group {os.environ.get('RANK', '0')}"
    received: list[int] = []
    current: list[_Group] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        for group in current:
            group.signal_all(signum)
            group.signal_all(signal.SIGCONT)  # a stopped member acts on it now

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    job_end = _JobEnd(who)
    restart = 0
    while True:
        try:
            group = _Group(command, args.group_size, restart, linux=linux)
        except OSError as exc:
            print(f"towers: cannot start {command[0]!r}: {exc}. Check the command.", file=sys.stderr, flush=True)
            return 127
        current[:] = [group]
        if received:  # a stop came while the group was being started
            group.signal_all(received[-1])
        ended = None
        while not group.done() and group.failure() is None and ended is None:
            time.sleep(_POLL_S)  # a monitor's poll, as torchrun's agent polls its workers
            group.poll(who, args.stopped_kill_s)
            ended = job_end.before_joining(group, restart)
        if ended is not None:  # started again after the last step: it would wait for a quorum that cannot come
            group.kill()
            print(f"towers: {who} found the job complete: {ended.describe()}, before this start of the group (restart "
                  f"{restart}) took part in a step; stopping it: nothing is left to train, and it is not started again",
                  file=sys.stderr, flush=True)
            code = 0
            break
        failed = group.failure()
        if failed is not None:
            group.kill()
        if failed is None or received:
            code = failed[1] if failed is not None else 0
            if code == 0 and not received:
                job_end.note()
            break
        member, code = failed
        error = job_end.failed()
        if error is not None:  # an error of the job, not of this group: a new start would meet it again, or train alone
            print(f"towers: {group.name(who, member)} {describe_exit(code)} on an error of the whole job ({error}); "
                  "it is not started again, and the job stops", file=sys.stderr, flush=True)
            break
        ended = job_end.ended()
        if ended is not None:  # the live groups finished the job's training meanwhile: a new start has nothing to do
            lost = "it" if args.group_size == 1 else group.name(who, member)
            print(f"towers: {who} found the job complete: {ended.describe()}, and {lost} (pid "
                  f"{group.members[member].pid}) {describe_exit(code)}; it is not started again", file=sys.stderr,
                  flush=True)
            code = 0
            break
        if restart >= args.restarts:
            print(f"towers: {group.name(who, member)} {describe_exit(code)} after {restart} restart(s) of the group, the "
                  "most --group-restarts allows; the job stops", file=sys.stderr, flush=True)
            break
        restart += 1
        size = "it" if args.group_size == 1 else f"its {args.group_size} processes"
        print(f"towers: {group.name(who, member)} (pid {group.members[member].pid}) {describe_exit(code)}; restarting "
              f"{size} alone (restart {restart} of {args.restarts}): the other groups train on and it heals from "
              "them", file=sys.stderr, flush=True)
        if args.report_dir:
            group_id = int(os.environ.get("RANK", "0"))
            write_report(args.report_dir, f"restart-group{group_id}-{restart}",
                         {"rank": group_id, "restart": restart, "description": describe_exit(code)})
    if code < 0:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL has no handler to reset
            pass
        os.kill(os.getpid(), -code)
    return code if 0 <= code < 256 else 1


if __name__ == "__main__":
    sys.exit(main())
