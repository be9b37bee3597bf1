"""Waiting for peers is visible and bounded: a peer that never comes, a mistyped host, a chief that never starts.

The real commands in new sessions, with short join timeouts; each test asserts the message (what
was awaited, since when, what to check), the progress lines while waiting, and the time bound.
The commands of one test run side by side (they use different ports), so a test costs about one
join timeout plus one ``import torch``.
"""

from __future__ import annotations

import json
import re
import socket
import textwrap
import time
from pathlib import Path

import pytest
from cli_support import clean_env, finish, start, towers_command

from towers.launch import free_port

pytestmark = pytest.mark.timeout(120)

JOIN_TIMEOUT_S = 4.0
#: Start-up (Python, torch) plus the join timeout plus the others' grace must fit in this.
BOUND_S = JOIN_TIMEOUT_S + 25.0

SCRIPT = """
import pathlib, sys
from towers import cluster
from towers.process_group import init_process_group

info = cluster.from_env()
init_process_group(info, backend="gloo", timeout_s=60)
pathlib.Path(sys.argv[1]).write_text("joined")  # must never happen here
"""


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def no_cpp_frames(text: str) -> bool:
    return "frame #" not in text and "Exception raised from" not in text


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "joins.py"
    path.write_text(SCRIPT)
    return path


def test_a_lone_node_reports_the_missing_one_and_a_mistyped_host_fails_at_once(script, tmp_path):
    port = free_port()
    launch = [*towers_command(), "launch", "--nproc-per-node", "1", "--monitor-interval", "0.2"]
    started = time.monotonic()
    alone = start([*launch, "--nnodes", "2", "--node-rank", "0", "--master-port", str(port), "--join-timeout",
                   f"{JOIN_TIMEOUT_S:g}", str(script), str(tmp_path / "alone")], cwd=tmp_path)
    typo_script = tmp_path / "typo.py"  # its own marker: the lone node is still waiting when this one ends
    typo_script.write_text(SCRIPT)
    typo = start([*launch, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "no-such-host.invalid:29500",
                  str(typo_script), str(tmp_path / "typo")], cwd=tmp_path)
    typo_done = finish([typo], deadline_s=BOUND_S, marker=str(typo_script))[0]
    typo_s = time.monotonic() - started
    alone_done = finish([alone], deadline_s=BOUND_S, marker=str(script))[0]
    alone_s = time.monotonic() - started

    err = alone_done.stderr
    assert alone_done.returncode == 1, err
    waiting = [line for line in err.splitlines() if "waiting for 1 of 2 nodes to join the rendezvous at" in line]
    assert waiting and all(f"127.0.0.1:{port}" in line and "missing: node 1" in line for line in waiting), err
    assert re.search(r"joined: node 0 \[host \S+ \S+, pid \d+\]", waiting[0]), waiting[0]
    final = err.strip().splitlines()[-1]
    assert final.startswith(f"towers launch: node 0: 1 of 2 nodes did not join the rendezvous at 127.0.0.1:{port} "
                            f"within the join timeout of {JOIN_TIMEOUT_S:g} s (waiting since "), err
    assert "missing: node 1" in final and "--join-timeout" in final and "--interface" in final
    assert JOIN_TIMEOUT_S <= alone_s < BOUND_S
    assert not (tmp_path / "alone").exists()  # no worker started

    err = typo_done.stderr
    assert typo_done.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("towers launch: node 1: the rendezvous host 'no-such-host.invalid' (--rdzv-endpoint) "
                                "does not resolve to an address: "), err
    assert lines[-1].endswith("Check the spelling, use the chief's IP address, or add the name to DNS or /etc/hosts "
                              "on this host."), err
    assert all(" INFO " in line for line in lines[:-1]), err  # one line of error, no traceback, no retries
    assert "gai error" not in err and no_cpp_frames(err)
    assert typo_s < 15.0, f"a mistyped host took {typo_s:.1f} s to fail"


def test_a_process_whose_peer_never_starts_says_whom_it_waits_for(script, tmp_path):
    tf_port = free_port()
    tf_config = {"cluster": {"chief": [f"127.0.0.1:{tf_port}"], "worker": ["127.0.0.1:1"]},
                 "task": {"type": "chief", "index": 0}}
    python = [str(Path(towers_command()[0]).with_name("python"))]
    if not Path(python[0]).exists():
        import sys

        python = [sys.executable]
    join_env = {"TOWERS_JOIN_TIMEOUT_S": f"{JOIN_TIMEOUT_S:g}"}
    started = time.monotonic()
    # The TF_CONFIG chief waits for a worker that is never started ...
    chief = start([*python, str(script), str(tmp_path / "chief")], cwd=tmp_path,
                  env=clean_env({**join_env, "TF_CONFIG": json.dumps(tf_config)}))
    # ... and torchrun-style rank 1 of 2 waits for a chief that is never started.
    orphan = start([*python, str(script), str(tmp_path / "orphan")], cwd=tmp_path,
                   env=clean_env({**join_env, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": str(closed_port())}))
    chief_done, orphan_done = finish([chief, orphan], deadline_s=BOUND_S, marker=str(script))
    elapsed = time.monotonic() - started

    err = chief_done.stderr
    assert chief_done.returncode != 0, err
    waiting = [line for line in err.splitlines() if "towers: waiting for 1 of 2 processes to join" in line]
    assert waiting and waiting[0].startswith("[rank 0/2] towers: waiting for 1 of 2 processes"), err
    assert "missing: rank 1 (worker:0 at 127.0.0.1:1)" in waiting[0]
    assert "joined: rank 0 (chief:0 at 127.0.0.1:" in waiting[0]
    final = err.strip().splitlines()[-1]
    assert final.startswith("towers.process_group.DistributedError: [rank 0/2] 1 of 2 processes did not join the "
                            f"rendezvous at 127.0.0.1:{tf_port} within the join timeout of {JOIN_TIMEOUT_S:g} s "
                            "(waiting since "), err
    assert "missing: rank 1 (worker:0 at 127.0.0.1:1)" in final and "TOWERS_JOIN_TIMEOUT_S" in final

    err = orphan_done.stderr
    assert orphan_done.returncode != 0, err
    assert "[rank 1/2] towers: waiting for the chief, rank 0 (node 0), to open the rendezvous 127.0.0.1:" in err, err
    assert "connection refused for" in err
    final = err.strip().splitlines()[-1]
    assert final.startswith("towers.process_group.DistributedError: [rank 1/2] the chief, rank 0 (node 0), did not open the "
                            "rendezvous 127.0.0.1:"), err
    assert f"within the join timeout of {JOIN_TIMEOUT_S:g} s (connections refused since " in final

    for done in (chief_done, orphan_done):
        assert no_cpp_frames(done.stderr) and "retry" not in done.stderr.lower(), done.stderr
    assert JOIN_TIMEOUT_S <= elapsed < BOUND_S
    assert not (tmp_path / "chief").exists() and not (tmp_path / "orphan").exists()


def test_two_nodes_on_one_host_join_and_train_whichever_starts_first(tmp_path):
    # towers' node join runs on node 0's store before torchrun's agent, which then shares that server.
    script = tmp_path / "two_nodes.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from towers import cluster
        from towers.process_group import init_process_group

        info = cluster.from_env()
        init_process_group(info, backend="gloo", timeout_s=60)
        value = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(value)
        print(f"rank {info.rank} of {info.world_size} on node {info.node_rank}: sum {value.item():g}", flush=True)
    """))
    port = free_port()
    launch = [*towers_command(), "launch", "--nproc-per-node", "1", "--monitor-interval", "0.2", "--nnodes", "2",
              "--master-port", str(port), "--join-timeout", "60"]
    node1 = start([*launch, "--node-rank", "1", str(script)], cwd=tmp_path)  # first: it may find the port refused
    node0 = start([*launch, "--node-rank", "0", str(script)], cwd=tmp_path)
    done0, done1 = finish([node0, node1], deadline_s=90, marker=str(script))
    assert (done0.returncode, done1.returncode) == (0, 0), done0.stderr + done1.stderr
    assert "rank 0 of 2 on node 0: sum 3" in done0.stdout, done0.stdout + done0.stderr
    assert "rank 1 of 2 on node 1: sum 3" in done1.stdout, done1.stdout + done1.stderr
