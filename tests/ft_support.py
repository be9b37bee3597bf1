"""What the fault-tolerance tests and their job scripts share: torchft's lighthouse as its own process, how a test
ends every process it started, and how a job script ends."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence


def lighthouse_process(peer_timeout_s: float) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse binary on a free loopback port, as its own process (so that killing it is real)."""
    from towers.launch import free_port

    port = free_port()
    timeout_ms = str(int(peer_timeout_s * 1000))
    argv = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1", "--bind",
            f"127.0.0.1:{port}", "--heartbeat_timeout_ms", timeout_ms, "--join_timeout_ms", timeout_ms,
            "--quorum_tick_ms", "20"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # ready once it says so (it logs every quorum after: drained, not read)
        if "listening on" in line.lower():
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    assert proc.poll() is None, f"the lighthouse exited with {proc.returncode}"
    return proc, f"http://127.0.0.1:{port}"


def stop_all(readers: Sequence[Any], lighthouse: subprocess.Popen, marker: str) -> None:
    """Kill the groups still running and the lighthouse; fail the test if any process with ``marker`` was left."""
    from cli_support import kill, processes_running

    for reader in readers:
        if reader.proc.poll() is None:
            kill([reader.proc.pid])
            reader.proc.wait(timeout=10)
    lighthouse.kill()
    lighthouse.wait(timeout=10)
    leftovers = processes_running(marker)
    kill(leftovers)
    assert not leftovers, f"processes left behind: {leftovers}"


def end_job(strategy: Any) -> None:
    """Leave the quorum and exit 0 at once: torchft's server threads need no goodbye."""
    strategy.shutdown()
    sys.stdout.flush()
    os._exit(0)
