"""What the fault-tolerance tests and their job scripts share: torchft's lighthouse as its own process, how a test
ends every process it started, how a job script ends, and where a job's processes listen."""

from __future__ import annotations

import ipaddress
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


def listening_sockets(marker: str) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every listening TCP socket of the processes whose command line holds ``marker``.

    Read from ``/proc`` (Linux): a process's socket inodes, then ``/proc/net/tcp`` and ``tcp6``. An
    IPv4-mapped IPv6 address is given as its IPv4 address.
    """
    owners: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or marker not in (entry / "cmdline").read_bytes().decode(errors="replace"):
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[target[8:-1]] = int(entry.name)
        except OSError:
            continue  # exited meanwhile
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in owners:  # 0A: LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)  # 32-bit words in host byte order (little-endian here)
            address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            found.append((owners[fields[9]], str(address), int(port, 16)))
    return found
