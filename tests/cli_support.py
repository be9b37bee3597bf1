"""Run commands as a user would: in a new session, under one deadline, with nothing left behind.

Shared by the tests that start the real ``towers`` CLI (launch, demo, bench, the same-script test).
On the deadline the whole session is ended (SIGTERM, which ``towers launch`` forwards to its
workers, then SIGKILL) and the test fails; with a ``marker`` (a path on the command line of every
process the command starts) the test also fails if any such process outlives the command.
"""

from __future__ import annotations

import os
import shutil
import signal
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import pytest

# Variables a launcher sets for its children: a test's command must not inherit the pytest process's.
_LAUNCH_VARIABLES = ("TOWERS_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK", "MASTER_", "TF_CONFIG", "SLURM_",
                     "TORCHELASTIC_", "OMP_NUM_THREADS")


def towers_command() -> list[str]:
    """Return the ``towers`` console script beside this interpreter, else ``python -m towers.cli``."""
    script = Path(sys.executable).with_name("towers")
    if script.exists():
        return [str(script)]
    found = shutil.which("towers")
    return [found] if found else [sys.executable, "-m", "towers.cli"]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return this process's environment without launcher variables, unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARIABLES)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def processes_running(marker: str) -> list[int]:
    """Return pids of live (not zombie) processes whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # exited meanwhile
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def kill(pids: Sequence[int]) -> None:
    """SIGKILL each pid that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(argv: Sequence[str], *, cwd: Path | str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in a new session (so its whole process group can be ended at once)."""
    return subprocess.Popen(list(argv), cwd=cwd, env=dict(env) if env is not None else clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def finish(procs: Sequence[subprocess.Popen], *, deadline_s: float,
           marker: str | None = None) -> list[subprocess.CompletedProcess]:
    """Wait for every command under one deadline and return their results; fail the test on the deadline."""
    deadline = time.monotonic() + deadline_s
    done: list[subprocess.CompletedProcess] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        outputs = [_end_session(p) for p in procs]
        if marker:
            kill(processes_running(marker))
        pytest.fail(f"not finished within {deadline_s} s: {[' '.join(map(str, p.args)) for p in procs]}\n{outputs}")
    if marker:
        leftovers = processes_running(marker)
        kill(leftovers)
        assert not leftovers, f"processes left behind: {leftovers}\n" + "\n".join(r.stdout + r.stderr for r in done)
    return done


def run(argv: Sequence[str], *, cwd: Path | str, deadline_s: float, marker: str | None = None,
        env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run one command as ``start`` + ``finish`` and return its result."""
    return finish([start(argv, cwd=cwd, env=env)], deadline_s=deadline_s, marker=marker)[0]


class OutputReader:
    """Read a started command's stdout and stderr in two threads, so a test can wait for lines as they come.

    ``select`` on ``proc.stdout`` is wrong for this: the text stream reads ahead, so one ``readline``
    may leave the next line in Python's buffer, where ``select`` cannot see it, and the test waits
    for a line it already holds. The threads own the pipes: use ``wait_for_lines`` while the command
    runs and ``collect`` (not ``communicate``) once it ends.
    """

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._lines: queue.Queue[str] = queue.Queue()
        self._out: list[str] = []
        self._err: list[str] = []
        self._threads = [threading.Thread(target=self._drain, args=(proc.stdout, self._out, True), daemon=True),
                         threading.Thread(target=self._drain, args=(proc.stderr, self._err, False), daemon=True)]
        for thread in self._threads:
            thread.start()

    def _drain(self, stream, into: list[str], announce: bool) -> None:
        for line in stream:
            into.append(line)
            if announce:
                self._lines.put(line)

    def wait_for_lines(self, wanted: int, prefix: str, *, deadline_s: float) -> list[str]:
        """Return the stdout lines starting with ``prefix`` once ``wanted`` of them came (fewer on the deadline or EOF)."""
        deadline = time.monotonic() + deadline_s
        found: list[str] = []
        while len(found) < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                line = self._lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if not self._threads[0].is_alive() and self._lines.empty():
                    break  # stdout closed: no more lines will come
                continue
            if line.startswith(prefix):
                found.append(line)
        return found

    def so_far(self) -> tuple[str, str]:
        """(stdout, stderr) read until now, while the command may still run (a post-mortem's)."""
        return "".join(self._out), "".join(self._err)

    def collect(self, *, timeout_s: float) -> tuple[str, str]:
        """Wait for the command to exit and its pipes to close; return (stdout, stderr)."""
        self.proc.wait(timeout=timeout_s)
        for thread in self._threads:
            thread.join(timeout=timeout_s)
        return "".join(self._out), "".join(self._err)


def _end_session(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is not None:
        return proc.communicate()
    os.killpg(proc.pid, signal.SIGTERM)  # towers launch forwards it to its workers
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def wait_for_exits(procs: Sequence, *, deadline_s: float) -> dict[int, float]:
    """Wait until every ``multiprocessing`` process in ``procs`` exits or ``deadline_s`` passes; return each exited
    process's index -> the wall-clock time it was seen to exit (those still running are left to the caller)."""
    from multiprocessing.connection import wait

    exited_at: dict[int, float] = {}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    deadline = time.monotonic() + deadline_s
    while sentinels and time.monotonic() < deadline:
        for s in wait(list(sentinels), timeout=max(0.0, deadline - time.monotonic())):
            exited_at[sentinels.pop(s)] = time.time()
    return exited_at
