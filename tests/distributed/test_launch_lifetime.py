"""`towers launch` leaves nothing behind and lets nobody in: launcher deaths, listening sockets, whole output lines."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli_support import OutputReader, clean_env, kill, processes_running, run, towers_command

pytestmark = pytest.mark.timeout(240)

DEADLINE_S = 90.0
GONE_WITHIN_S = 10.0

WAITER = """
import os, signal, sys
# one write per line, then wait for a signal: the job does nothing else
sys.stdout.write(f"ready {os.environ['RANK']} {os.getpid()}\\n")
sys.stdout.flush()
while True:
    signal.pause()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _start_waiting_job(tmp_path: Path, index: int) -> tuple[subprocess.Popen, OutputReader, Path]:
    script = tmp_path / f"waiter{index}.py"
    script.write_text(WAITER)
    proc = subprocess.Popen([*towers_command(), "launch", "--nproc-per-node", "2", "--monitor-interval", "0.2",
                             str(script)], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    return proc, OutputReader(proc), script


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_no_rank_outlives_a_killed_or_terminated_launcher_ten_of_ten(tmp_path):
    # 10 launches of a 2-process job that only waits; one rank of each is stopped (SIGSTOP), then the
    # launcher (only it: not its session) gets SIGKILL (as from the OOM killer) or SIGTERM (a scheduler).
    # Five jobs run at a time, to keep the test's cost near 2 launches' worth of torch imports each round.
    outcomes = []
    for round_ in range(2):
        jobs = [_start_waiting_job(tmp_path, round_ * 5 + i) for i in range(5)]
        try:
            for i, (proc, output, _script) in enumerate(jobs):
                lines = output.wait_for_lines(2, "[rank ", deadline_s=DEADLINE_S)
                pids = {int(line.split()[4]) for line in lines if " ready " in line}  # [rank R]: ready R PID
                assert len(pids) == 2, f"job {round_ * 5 + i} did not start: {lines}\n{output.collect(timeout_s=5)}"
                os.kill(sorted(pids)[1], signal.SIGSTOP)
                sig = signal.SIGKILL if (round_ * 5 + i) % 2 == 0 else signal.SIGTERM
                killed_at = time.monotonic()
                os.kill(proc.pid, sig)
                while any(_alive(pid) for pid in pids) and time.monotonic() - killed_at < GONE_WITHIN_S + 5:
                    time.sleep(0.05)  # polling the outcome we measure, not synchronising with the job
                outcomes.append((sig.name, round(time.monotonic() - killed_at, 2),
                                 sorted(pid for pid in pids if _alive(pid))))
        finally:
            for proc, _, script in jobs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                kill(processes_running(str(script)))
    assert len(outcomes) == 10
    assert all(not left and took <= GONE_WITHIN_S for _, took, left in outcomes), outcomes


LISTENERS = """
import json, os, sys
from pathlib import Path

def listeners(marker):
    # every listening TCP socket of the job: the processes whose command line holds the script's path
    # (the launcher, the ranks, and under ps their supervisors)
    inodes = set()
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or marker not in (entry / "cmdline").read_bytes().decode(errors="replace"):
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    print("LISTENERS " + json.dumps(found), flush=True)
"""

CHATTY = LISTENERS + """
import towers
strategy = towers.MirroredStrategy()
rank = strategy.replica_id
strategy.barrier()
if rank == 0:  # while the store and Gloo are up
    listeners(__file__)
strategy.barrier()
for i in range(1500):
    print(json.dumps({"rank": rank, "i": i, "pad": "x" * 500}))
    print(json.dumps({"rank": rank, "i": i, "err": "y" * 300}), file=sys.stderr)
strategy.barrier()
"""

PS_JOB = LISTENERS + """
import torch
import towers
strategy = towers.strategy_from_env(mode="sync", timeout_s=30)  # the ps task serves here, then exits
net, optimizer = strategy.prepare(torch.nn.Linear(4, 2), None)
if strategy.is_chief:  # the ps links are up: the chief's pull/push pair with the ps task
    net(torch.ones(1, 4)).sum().backward()
    listeners(__file__)
strategy.shutdown()
"""


def _address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    # /proc/net/tcp{,6}: the address as 32-bit words in host byte order (little-endian here), then the port
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    swapped = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(swapped), int(port, 16)


def _assert_loopback_only(stdout: str) -> None:
    listeners = [json.loads(line.split("LISTENERS ", 1)[1]) for line in stdout.splitlines() if "LISTENERS " in line]
    assert len(listeners) == 1, stdout[-2000:]
    addresses = [_address(a) for a in listeners[0]]
    assert addresses, "the job should listen somewhere (store, Gloo)"
    assert not [a for a in addresses if a[0].is_unspecified], f"listening on every interface: {addresses}"
    assert all(a[0].is_loopback or (isinstance(a[0], ipaddress.IPv6Address) and a[0].ipv4_mapped is not None
                                    and a[0].ipv4_mapped.is_loopback) for a in addresses), addresses


def test_one_host_parameter_server_job_listens_on_loopback_only(tmp_path):
    script = tmp_path / "ps_job.py"
    script.write_text(textwrap.dedent(PS_JOB))
    result = run([*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "ps", "--num-ps", "1",
                  str(script)], cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_loopback_only(result.stdout)


def test_one_host_job_listens_on_loopback_only_and_every_output_line_is_whole_and_ranked(tmp_path):
    script = tmp_path / "chatty.py"
    script.write_text(textwrap.dedent(CHATTY))
    result = run([*towers_command(), "launch", "--nproc-per-node", "2", str(script)], cwd=tmp_path,
                 deadline_s=DEADLINE_S, marker=str(script))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _assert_loopback_only(result.stdout)

    for stream, key in ((result.stdout, "pad"), (result.stderr, "err")):
        seen = {0: 0, 1: 0}
        for line in stream.splitlines():
            if f'"{key}"' not in line:
                continue
            match = re.fullmatch(r"\[rank (\d)\]: (\{.*\})", line)
            assert match, f"a line that is not whole or carries no rank: {line[:200]!r}"
            record = json.loads(match.group(2))
            assert record["rank"] == int(match.group(1)), line[:200]
            assert record["i"] == seen[record["rank"]], f"rank {record['rank']} line {seen[record['rank']]} missing"
            seen[record["rank"]] += 1
        assert seen == {0: 1500, 1: 1500}, seen


@pytest.mark.skipif(not os.uname().sysname == "Linux", reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_stopped_rank_does_not_outlive_its_parameter_server_supervisor(sig, tmp_path):
    # The supervisor `towers launch --strategy ps` runs each rank under; its child is stopped, then it is signalled.
    child = "import os, signal, sys; sys.stdout.write(f'{os.getpid()}\\n'); sys.stdout.flush(); signal.pause()"
    proc = subprocess.Popen([sys.executable, "-m", "towers.launch.supervise", "--", sys.executable, "-c", child],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pid = None
    try:
        pid = int(proc.stdout.readline())
        os.kill(pid, signal.SIGSTOP)
        signalled_at = time.monotonic()
        os.kill(proc.pid, sig)
        proc.wait(timeout=GONE_WITHIN_S)
        while _alive(pid) and time.monotonic() - signalled_at < GONE_WITHIN_S:
            time.sleep(0.05)  # polling the outcome we measure
        assert not _alive(pid), f"the supervised rank outlived its supervisor ({sig.name})"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if pid is not None and _alive(pid):
            kill([pid])
