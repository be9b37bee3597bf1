"""No process outlives ``towers launch``: workers die with the launcher, stopped ones included.

torchrun's agent starts each worker in a session of its own (``start_new_session``), so a
launcher that is killed (SIGKILL, the OOM killer, a scheduler's timeout) does not take its
workers with it, and one that is told to stop (SIGTERM) sends SIGTERM to each worker's group,
which a stopped worker (SIGSTOP, ``Ctrl-Z``, a debugger) leaves pending until the agent's SIGKILL
30 s later. Two pieces close both gaps, on Linux:

- ``guarded_command`` prefixes each worker's command with a few lines of Python (``-I -S``: no
  site, no torch, ~20 ms) that set ``PR_SET_PDEATHSIG`` = SIGKILL and ``exec`` the real command.
  The setting survives ``exec``, so the worker is killed by the kernel when the launcher's thread
  that started it dies, however it dies; a launcher that died before the setting took effect is
  seen by the parent pid check, and the worker does not start.
- ``continue_stopped_children`` watches the signals the launcher receives (``signal.set_wakeup_fd``,
  next to whatever Python handler torch installed) and sends SIGCONT to every child's process
  group when the launcher is told to stop, so a stopped worker acts on the agent's SIGTERM at once.

Elsewhere the command is returned unchanged and the context does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

__all__ = ["guarded_command", "continue_stopped_children", "child_pids", "STOP_SIGNALS"]

#: The signals on which the launcher stops its workers (torchrun's agent handles these).
STOP_SIGNALS = tuple(int(getattr(signal, name)) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                     if hasattr(signal, name))

# argv: [-c, PARENT_PID, COMMAND...]. Kept free of imports beyond the standard library's C parts: it runs
# once per worker start, before the worker's own interpreter.
_GUARD = (
    "import ctypes,os,sys\n"
    "ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "if os.getppid()!=int(sys.argv[1]):os._exit(137)\n"  # the launcher died before the line above took effect
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def _linux() -> bool:
    return sys.platform.startswith("linux")


def guarded_command(cmd: str | Callable[..., Any], cmd_args: Sequence[str], *,
                    python: str | None = None) -> tuple[str | Callable[..., Any], list[str]]:
    """Return the agent's ``(entrypoint, args)`` that run ``cmd cmd_args`` and die with this process (Linux).

    ``cmd`` is what ``torch.distributed.run.config_from_args`` returned: an executable, or (for
    ``--run-path``) a function that runs ``cmd_args[0]`` as a script, which becomes ``python -u``.
    Off Linux, ``(cmd, list(cmd_args))`` is returned unchanged.
    """
    if not _linux():
        return cmd, list(cmd_args)
    python = python or sys.executable
    child = [cmd, *cmd_args] if isinstance(cmd, str) else [python, "-u", *cmd_args]
    return python, ["-I", "-S", "-c", _GUARD, str(os.getpid()), *(str(part) for part in child)]


def child_pids(pid: int | None = None) -> list[int]:
    """Return the pids of the live children of ``pid`` (default: this process), read from ``/proc``."""
    pid = os.getpid() if pid is None else pid
    children: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def _continue(pid: int) -> None:
    for send in (lambda: os.killpg(os.getpgid(pid), signal.SIGCONT), lambda: os.kill(pid, signal.SIGCONT)):
        with contextlib.suppress(OSError):
            send()


@contextlib.contextmanager
def continue_stopped_children() -> Iterator[None]:
    """While inside, a stop signal this process receives also sends SIGCONT to its children's process groups.

    Needs the main thread of a Linux process (``signal.set_wakeup_fd``); elsewhere it does nothing.
    The signal's Python handler (torch's agent installs one) still runs as before.
    """
    if not _linux() or threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_fd)
        os.close(write_fd)
        yield
        return

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return  # the write end was closed: the context is over
            if any(byte in STOP_SIGNALS for byte in data):
                for pid in child_pids():
                    _continue(pid)

    thread = threading.Thread(target=watch, name="towers-continue-children", daemon=True)
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_fd)
        thread.join(timeout=1.0)
        os.close(read_fd)
