"""Jobs across two hosts: two network namespaces joined by a veth pair (``netns_support``).

By default each host's own name resolves to 127.0.1.1 *on that host* (Debian's ``/etc/hosts``),
the case where Gloo's default binds loopback and the parameter-server links used to fail. Nobody
names an interface except node 1 of the launch job (``--interface``): every other process finds it.

Scenarios: MirroredStrategy over ``towers launch --nnodes 2``; a TF_CONFIG chief + worker job
(MultiWorkerMirrored), also with plain names; a TF_CONFIG parameter-server job of 1 ps + 2 workers,
sync and async, with the chief on one host and the worker and ps task on the other (each host its
own /dev/shm: the worker beside the ps shares memory with it, the chief's pair keeps the wire). Each checks
that the final parameters agree bit for bit across hosts, that the collectives used the veth
interface, and that no process is left behind. Skipped (with the reason) without root or ``ip netns``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cli_support import clean_env, finish, start, towers_command
from netns_support import Host, host_pair_factory

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 60.0
PORT = 29411

SCRIPT = """
    import json, os, socket, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    import towers

    MODE = sys.argv[1]  # "-" (not a parameter-server job), "sync" or "async"
    strategy = towers.strategy_from_env(timeout_s=30, **({} if MODE == "-" else {"mode": MODE}))
    torch.manual_seed(0)
    with strategy.scope():
        net = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net, optimizer = strategy.prepare(net, optimizer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    batches = strategy.distribute_dataset((x, (x[:, 0] > 0).long()), 8, shuffle=False)

    def step(xb, yb):
        loss = towers.compute_average_loss(F.cross_entropy(net(xb), yb, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for xb, yb in batches:
        strategy.run(step, args=(xb, yb))
    strategy.barrier()  # every update is applied before anyone reads the parameters
    state = strategy.unwrap(net).state_dict()  # under ps: pulled from the ps tasks
    print("RESULT " + json.dumps({
        "rank": strategy.process_info.rank, "host": socket.gethostname(),
        "interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        "shared": strategy.wire_stats()["shared_memory_bytes"] if hasattr(strategy, "wire_stats") else None,
        "params": {k: [float(v).hex() for v in t.flatten().tolist()] for k, t in state.items()}}), flush=True)
    strategy.shutdown()
"""


@pytest.fixture
def two_hosts(tmp_path, request):
    """Return ``make(loopback_names=True) -> (hosta, hostb)``; the namespaces are deleted after the test."""
    return host_pair_factory(tmp_path, request)


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "two_host_job.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def _run_on(runs: list[tuple[Host, list[str], dict[str, str]]], *, cwd: Path, marker: str) -> tuple[list, float]:
    """Start every ``(host, argv, extra env)`` at once; return their results and the wall time (deadline enforced)."""
    began = time.monotonic()
    procs = [start(host.command(argv), cwd=cwd, env=clean_env({"OMP_NUM_THREADS": "1", **env}))
             for host, argv, env in runs]
    done = finish(procs, deadline_s=DEADLINE_S, marker=marker)
    return done, time.monotonic() - began


def _results(done: list[subprocess.CompletedProcess]) -> dict[int, dict]:
    for result in done:
        assert result.returncode == 0, f"{' '.join(result.args)}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    # towers launch prefixes each worker's line with "[rank N]: "
    lines = [line.split("]: ", 1)[-1] for r in done for line in r.stdout.splitlines() if "RESULT " in line]
    return {entry["rank"]: entry for entry in (json.loads(line[len("RESULT "):]) for line in lines)}


def _check_agreement(results: dict[int, dict], expected: dict[int, Host]) -> None:
    assert sorted(results) == sorted(expected), results
    for rank, host in expected.items():
        assert results[rank]["host"] == host.name
        assert results[rank]["interface"] == host.interface, (rank, results[rank])  # never loopback
    params = [results[rank]["params"] for rank in sorted(results)]
    assert all(p == params[0] for p in params), params  # bit for bit, across hosts


def _tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})}


def test_mirrored_over_towers_launch_nnodes_2(two_hosts, tmp_path):
    hosta, hostb = two_hosts()
    script = _script(tmp_path)

    def node(rank: int, *extra: str) -> list[str]:
        return [*towers_command(), "launch", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                "--master-addr", hosta.name, "--master-port", str(PORT), "--strategy", "mirrored",
                "--monitor-interval", "0.2", *extra, str(script), "-"]

    # node 0 finds its interface (its own name is loopback here); node 1 is told which one
    done, seconds = _run_on([(hosta, node(0), {}), (hostb, node(1, "--interface", hostb.interface), {})],
                            cwd=tmp_path, marker=str(script))
    _check_agreement(_results(done), {0: hosta, 1: hostb})
    print(f"mirrored over towers launch --nnodes 2: {seconds:.1f} s")


@pytest.mark.parametrize("loopback_names", [True, False], ids=["own-name-is-loopback", "plain-names"])
def test_tf_config_chief_and_worker(two_hosts, tmp_path, loopback_names):
    hosta, hostb = two_hosts(loopback_names)
    script = _script(tmp_path)
    cluster = {"chief": [f"{hosta.name}:{PORT}"], "worker": [f"{hostb.name}:{PORT}"]}
    argv = [sys.executable, str(script), "-"]
    done, seconds = _run_on([(hosta, argv, _tf_config(cluster, "chief", 0)),
                             (hostb, argv, _tf_config(cluster, "worker", 0))], cwd=tmp_path, marker=str(script))
    _check_agreement(_results(done), {0: hosta, 1: hostb})
    print(f"TF_CONFIG chief + worker ({'loopback' if loopback_names else 'plain'} names): {seconds:.1f} s")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parameter_servers_across_hosts(two_hosts, tmp_path, mode):
    hosta, hostb = two_hosts()
    script = _script(tmp_path)
    # the chief on one host; the other worker and the ps task on the other: chief <-> ps crosses hosts
    cluster = {"chief": [f"{hosta.name}:{PORT}"], "worker": [f"{hostb.name}:{PORT + 1}"],
               "ps": [f"{hostb.name}:{PORT + 2}"]}
    argv = [sys.executable, str(script), mode]
    done, seconds = _run_on([(hosta, argv, _tf_config(cluster, "chief", 0)),
                             (hostb, argv, _tf_config(cluster, "worker", 0)),
                             (hostb, argv, _tf_config(cluster, "ps", 0))], cwd=tmp_path, marker=str(script))
    results = _results(done)
    _check_agreement(results, {0: hosta, 1: hostb})
    # each host has its own /dev/shm: the chief's pair crosses hosts on the wire, the worker beside the ps shares
    assert results[0]["shared"] == 0 and results[1]["shared"] > 0, results
    print(f"parameter servers ({mode}) across hosts: {seconds:.1f} s")


def test_fault_tolerant_over_towers_launch_nnodes_2(two_hosts, tmp_path):
    """A replica group on each host; the one on host b is SIGKILLed, restarted there alone, and heals across hosts."""
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from cli_support import OutputReader, kill, processes_running
    from ft_job import done_step, one_device_reference

    JOB = Path(__file__).resolve().parents[1] / "ft_job.py"

    hosta, hostb = two_hosts()
    stop_file = tmp_path / "stop"

    def node(rank: int, *extra: str) -> list[str]:
        return [*towers_command(), "launch", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                "--master-addr", hosta.name, "--master-port", str(PORT), "--strategy", "ft",
                "--strategy-option", "peer_timeout_s=1", "--monitor-interval", "0.2", *extra, str(JOB), "env", "-",
                str(stop_file), str(tmp_path), "--fail-group", "1", "--fail-at", "4", "--fail-how", "kill"]

    env = clean_env({"OMP_NUM_THREADS": "1", "RUST_LOG": "warn"})
    nodes = [OutputReader(start(host.command(argv), cwd=tmp_path, env=env))
             for host, argv in ((hosta, node(0)), (hostb, node(1, "--interface", hostb.interface)))]
    try:
        assert nodes[1].wait_for_lines(1, "[rank 1]: failing", deadline_s=DEADLINE_S), "".join(nodes[1]._err[-30:])
        back = nodes[1].wait_for_lines(1, "[rank 1]: step", deadline_s=DEADLINE_S)
        assert back and " groups 2 " in back[0], f"{back} {''.join(nodes[1]._err[-30:])}"
        stop_file.touch()
        results = [reader.collect(timeout_s=DEADLINE_S) for reader in nodes]
    finally:
        for reader in nodes:
            if reader.proc.poll() is None:
                kill([reader.proc.pid])
        leftovers = processes_running(str(JOB))
        kill(leftovers)
    assert not leftovers, f"processes left behind: {leftovers}"
    for reader, (out, err) in zip(nodes, results):
        assert reader.proc.returncode == 0, f"exit {reader.proc.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    assert "replica group 1 was restarted alone 1 time(s)" in results[1][1]
    stop_at = done_step(results[0][0] + results[1][0], 2)
    final = [torch.load(tmp_path / f"group{g}.pt") for g in (0, 1)]
    reference = one_device_reference(stop_at)
    for key in final[0]:
        assert torch.equal(final[0][key], final[1][key]), key  # bit for bit, across hosts
        torch.testing.assert_close(final[0][key], reference[key], rtol=1e-4, atol=1e-5)
