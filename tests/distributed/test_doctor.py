"""``towers doctor`` as a user runs it: on each of two hosts (network namespaces), and under ``towers launch``.

* Two hosts whose own names resolve to loopback: both doctors pass, name the veth interface and
  address of each host, and measure latency, bandwidth, clock offset and all-reduce bandwidth.
* A node whose rendezvous never comes: it says, while it waits, for whom, then fails naming the fix.
* A wrong rendezvous address (a name that resolves to loopback on a non-rendezvous node) and an
  interface that does not exist fail at once with the fix (no torch rendezvous started).
* Under ``towers launch --nproc-per-node 2 -m towers.doctor``: the job's own environment is read.
"""

from __future__ import annotations

import re
import time

import pytest
from cli_support import clean_env, finish, run, start, towers_command
from netns_support import host_pair_factory

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 60.0
PORT = 29433


@pytest.fixture
def two_hosts(tmp_path, request):
    """Return ``make(loopback_names=True) -> (hosta, hostb)``; the namespaces are deleted after the test."""
    return host_pair_factory(tmp_path, request)


def _doctor(*args: str) -> list[str]:
    return [*towers_command(), "doctor", "--size-mb", "1", "--repeats", "3", *args]


def test_doctor_on_two_hosts_reports_interfaces_and_measures_links(two_hosts, tmp_path):
    hosta, hostb = two_hosts()
    began = time.monotonic()
    common = ("--nnodes", "2", "--master-addr", hosta.name, "--master-port", str(PORT), "--timeout-s", "30")
    procs = [start(host.command(_doctor(*common, "--node-rank", str(rank))), cwd=tmp_path,
                   env=clean_env({"OMP_NUM_THREADS": "1"})) for rank, host in enumerate((hosta, hostb))]
    done = finish(procs, deadline_s=DEADLINE_S, marker=f"--master-port {PORT}")
    seconds = time.monotonic() - began
    for rank, (host, result) in enumerate(zip((hosta, hostb), done)):
        out = result.stdout
        assert result.returncode == 0, f"rank {rank}\nstdout:\n{out}\nstderr:\n{result.stderr}"
        assert f"towers doctor: rank {rank} of 2 (node {rank}), rendezvous hosta:{PORT}" in out, out
        # its own name is loopback here: a warning with the fix, and the veth interface chosen instead
        assert f"warn  host name   {host.name} resolves to 127.0.1.1 (loopback) here" in out, out
        assert f"ok    interface   {host.interface} ({host.address}/24): " in out, out
        assert re.search(rf"ok    rendezvous  hosta:{PORT} -> (127\.0\.1\.1, served here|10\.77\.0\.1, reached from "
                         r"10\.77\.0\.2)", out), out
        assert "ok    peers       2 rank(s) joined from 2 host(s)" in out, out
        for peer in (hosta, hostb):  # every node sees both hosts' names, interfaces and addresses
            assert re.search(rf"{peer.name}\s+{peer.interface}\s+{peer.address}", out), out
        link = re.search(r"0<->1\s+([\d.]+) ms\s+([\d.]+) GB/s\s+([+-][\d.]+) s", out)
        assert link and float(link[1]) > 0 and float(link[2]) > 0 and abs(float(link[3])) < 1.0, out
        bus = re.search(r"all-reduce of 1 MB over 2 ranks: ([\d.]+) ms, bus bandwidth ([\d.]+) GB/s", out)
        assert bus and float(bus[1]) > 0 and float(bus[2]) > 0, out
        assert f"Other hosts must resolve {host.name} to {host.address}" in out, out
    print(f"towers doctor on two hosts: {seconds:.1f} s\n{done[1].stdout}")


def test_doctor_says_whom_it_waits_for_then_what_to_fix(two_hosts, tmp_path):
    hosta, hostb = two_hosts()
    node1 = ("--nnodes", "2", "--node-rank", "1", "--master-port", str(PORT))
    began = time.monotonic()
    procs = [start(hostb.command(_doctor(*node1, *args)), cwd=tmp_path, env=clean_env()) for args in (
        ("--master-addr", hosta.name, "--timeout-s", "2"),  # node 0 never starts its rendezvous
        ("--master-addr", hostb.name),  # its own name: loopback on this host, not node 0
        ("--master-addr", hosta.name, "--interface", "eth9"),  # no such interface
    )]
    never, own_name, no_interface = finish(procs, deadline_s=DEADLINE_S, marker=f"--master-port {PORT}")
    seconds = time.monotonic() - began
    for result in (never, own_name, no_interface):
        assert result.returncode == 1, result
    assert f"towers doctor: waiting for the rendezvous hosta:{PORT} (10.77.0.1) on node 0" in never.stderr, never
    assert re.search(rf"FAIL  rendezvous  hosta:{PORT} \(10\.77\.0\.1\) not reachable after [\d.]+ s", never.stdout)
    assert "Start towers doctor (or the job) on node 0 too" in never.stdout, never.stdout
    assert "FAIL  rendezvous  hostb resolves to 127.0.1.1 (loopback) on this host, but the rendezvous is on node 0"\
        in own_name.stdout, own_name.stdout
    assert "FAIL  interface   No network interface called 'eth9' on this host" in no_interface.stdout, no_interface
    assert f"{hostb.interface} (10.77.0.2/24)" in no_interface.stdout, no_interface.stdout  # the choices
    print(f"towers doctor failures: {seconds:.1f} s")


def test_doctor_under_towers_launch_reads_the_job(tmp_path):
    result = run([*towers_command(), "launch", "--nproc-per-node", "2", "--monitor-interval", "0.2", "-m",
                  "towers.doctor", "--size-mb", "1", "--repeats", "3"], cwd=tmp_path, deadline_s=DEADLINE_S,
                 marker="towers.doctor")
    assert result.returncode == 0, result
    for rank in (0, 1):
        assert f"towers doctor: rank {rank} of 2 (node 0), rendezvous 127.0.0.1:" in result.stdout, result.stdout
    assert "ok    peers       2 rank(s) joined from 1 host(s)" in result.stdout, result.stdout
    assert result.stdout.count("all-reduce of 1 MB over 2 ranks") == 1, result.stdout  # tables: once per node


def test_doctor_flags_are_checked_and_one_process_needs_no_rendezvous(capsys):
    from towers.cli import main

    assert main(["doctor", "--node-rank", "1"]) == 2
    assert "--node-rank needs --nnodes. Received: --node-rank 1" in capsys.readouterr().err
    assert main(["doctor", "--size-mb", "0"]) == 2
    assert "size_mb must be > 0. Received: 0.0" in capsys.readouterr().err
    assert main(["doctor", "--nnodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "ok    rendezvous  one process: nothing to reach" in out and "what to fix: nothing" in out, out
