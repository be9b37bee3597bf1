"""Ray Train across two hosts: a Ray head in one network namespace, a worker node in the other (joined by a veth
pair), the README's loop at 2 workers, one per host, equal to one process within the suite's tolerance; towers opens
no socket of its own there (each worker's TCP sockets, read from /proc, are the same after the job as before it).

Each host's name resolves to 127.0.1.1 on that host, as Debian sets it up: Gloo would advertise loopback, so each
node's ``ray start`` runs with ``GLOO_SOCKET_IFNAME`` naming its interface, which Ray's workers inherit (Ray makes
the process group, before any towers code runs). Skipped with the reason where namespaces cannot be made (not
root). Every Ray process of the test is ended by pid at the end (their command lines name the test's temporary
directories); ``ray stop`` is not used, as it would end every Ray process of the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from cli_support import clean_env, kill, processes_running
from netns_support import Host, host_pair_factory

pytest.importorskip("ray", reason="Ray Train is not installed: pip install 'towers[ray]'")

pytestmark = pytest.mark.timeout(600)

TESTS = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379
ATOL = 1e-4
#: Ray's token authentication: every node, probe and driver of the test's cluster carries the same token.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}

DRIVER = '''
import json, sys
import ray, ray.train
from ray.train.torch import TorchTrainer
import towers.ray
import ray_job

head, out, storage = sys.argv[1:4]
ray.init(address=f"{head}:{PORT}")
trainer = TorchTrainer(
    towers.ray.train_loop(ray_job.ray_entry),
    train_loop_config={"job": "readme", "strategy": "mirrored", "out": out, "sockets": out + ".sockets"},
    scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False,
                                           resources_per_worker={"CPU": 1, "towers_host": 1}),
    run_config=ray.train.RunConfig(storage_path=storage, name="two-hosts"))
result = trainer.fit()
print("RESULT " + json.dumps({"error": None if result.error is None else str(result.error)}), flush=True)
ray.shutdown()
'''.replace("{PORT}", str(PORT))


@pytest.fixture
def two_hosts(tmp_path, request):
    return host_pair_factory(tmp_path, request)(loopback_names=True)


def _start_node(host: Host, head: Host, temp: str) -> subprocess.Popen:
    env = clean_env({**RAY_ENV, "PYTHONPATH": str(TESTS), "GLOO_SOCKET_IFNAME": host.interface})
    role = (["--head", "--port", str(PORT), "--temp-dir", temp, "--include-dashboard", "false"] if host is head
            else ["--address", f"{head.address}:{PORT}"])
    argv = [RAY, "start", "--block", *role, "--node-ip-address", host.address, "--num-cpus", "2",
            "--resources", json.dumps({"towers_host": 1}), "--disable-usage-stats"]
    return subprocess.Popen(host.command(argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)


def _wait_for_nodes(head: Host, count: int, deadline_s: float, nodes: list[subprocess.Popen]) -> None:
    probe = f"import ray; ray.init(address='{head.address}:{PORT}'); print(len([n for n in ray.nodes() if n['Alive']]))"
    deadline = time.monotonic() + deadline_s
    done = None
    while time.monotonic() < deadline:
        if any(node.poll() is not None for node in nodes):
            break
        done = subprocess.run(head.command([sys.executable, "-c", probe]), env=clean_env(RAY_ENV),
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(1)
    ended = [(node.returncode, node.stderr.read()[-3000:] if node.poll() is not None and node.stderr else "") for node in nodes]
    pytest.fail(f"the Ray cluster did not reach {count} nodes within {deadline_s} s. Nodes: {ended}. Last probe: "
                f"{done.stdout[-2000:] + done.stderr[-3000:] if done else None}")


def test_the_readme_script_on_two_ray_hosts_equals_one_process(two_hosts, tmp_path):
    hosta, hostb = two_hosts
    temp = tempfile.mkdtemp(prefix="towers-ray2-", dir="/tmp")  # Ray's session (and sockets) of both nodes
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(_start_node(hosta, hosta, temp))
        _wait_for_nodes(hosta, 1, 60, nodes)
        nodes.append(_start_node(hostb, hosta, temp))
        _wait_for_nodes(hosta, 2, 60, nodes)
        driver = tmp_path / "driver.py"
        driver.write_text(DRIVER)
        out = tmp_path / "ray.pt"
        done = subprocess.run(hosta.command([sys.executable, str(driver), hosta.address, str(out), str(tmp_path / "st")]),
                              env=clean_env({**RAY_ENV, "PYTHONPATH": str(TESTS)}),
                              capture_output=True, text=True, timeout=300)
        assert '"error": null' in done.stdout, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        one = subprocess.run([sys.executable, str(TESTS / "ray_job.py"), "readme", str(tmp_path / "one.pt")],
                             env=clean_env(), capture_output=True, text=True, timeout=120)
        assert one.returncode == 0, one.stderr[-3000:]
        got, want = torch.load(out, weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst <= ATOL, worst
        placed = [line for line in (done.stdout + done.stderr).splitlines() if "world_rank=" in line]
        assert any(f"ip={hosta.address}" in line for line in placed), placed  # Ray's own record of the placement:
        assert any(f"ip={hostb.address}" in line for line in placed), placed  # one worker on each host
        # towers opens no socket of its own under Ray (it trains on Ray's process group): the workers hold the same
        # TCP sockets after the job as before it; the group's connections cross the link between the two interfaces
        # and its listener is on this host's interface, not on loopback or the 127.0.1.1 the hosts' names resolve to.
        # (Ray's own listeners, its store at MASTER_PORT among them, are on every interface: Ray's choice.)
        interfaces = {hosta.address, hostb.address}
        for rank in (0, 1):
            held = json.loads(Path(f"{out}.sockets.{rank}.json").read_text())
            assert sorted(held["after"]) == sorted(held["before"]), (rank, held)
            assert any(state == "ESTABLISHED" and {local, remote} == interfaces for state, local, remote in held["after"])
            assert not [s for s in held["after"] if s[1].startswith("127.")], (rank, held)
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, 15)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while processes_running(temp) and time.monotonic() < deadline:
            time.sleep(0.3)
        left = processes_running(temp)
        kill(left)
        for node in nodes:
            try:
                os.killpg(node.pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
