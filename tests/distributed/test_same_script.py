"""Invariant 2 (same script): one file runs unchanged as ``python script.py`` (one replica) and under
``towers launch --nproc-per-node 2 --strategy mirrored`` (two replicas), and across two launchers
(``--nnodes 2``: MultiWorkerMirroredStrategy), with the same final parameters and losses, printed
once (by the chief). Also the custom-loop example, end to end.

Every command runs in a new session with a deadline; on timeout the whole process group is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 120
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loop.py"

SCRIPT = textwrap.dedent('''
    import json
    import torch
    import torch.nn.functional as F
    import towers

    strategy = towers.strategy_from_env()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(21, 1, 6, 6, generator=g), torch.randint(0, 3, (21,), generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset((x, y), global_batch_size=8, shuffle=True, seed=5)

    def step(xb, yb):
        loss = towers.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for epoch in range(2):
        for xb, yb in batches:
            losses.append(strategy.reduce("sum", strategy.run(step, args=(xb, yb))).item())
    params = [p.detach().flatten().tolist() for p in strategy.unwrap(model).parameters()]
    if strategy.is_chief:
        print("RESULT " + json.dumps({"strategy": type(strategy).__name__,
                                      "replicas": strategy.num_replicas_in_sync,
                                      "losses": losses, "params": params}))
    strategy.barrier()
    strategy.shutdown()
''')


def _start(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERS_", "RANK", "WORLD_SIZE", "LOCAL_",
                                                                     "MASTER_", "TF_CONFIG", "SLURM_"))}
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    """Wait for every command under one deadline; on timeout kill every process group and fail."""
    deadline = time.monotonic() + DEADLINE_S
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        outputs = [p.communicate() for p in procs]
        pytest.fail(f"not finished within {DEADLINE_S} s: {[' '.join(p.args) for p in procs]}\n{outputs}")
    for r in done:
        assert r.returncode == 0, f"{' '.join(r.args)} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return done


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return _finish([_start(argv, cwd)])[0]


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line (the chief's), got:\n{stdout}"
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("same_script") / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def single(script) -> dict:
    """The script run with plain `python`: one replica."""
    return _result(_run([sys.executable, str(script)], script.parent).stdout)


def test_one_script_runs_unchanged_on_one_and_two_replicas(script, single, tmp_path):
    launched = _result(_run([sys.executable, "-m", "towers.cli", "launch", "--nproc-per-node", "2",
                             "--strategy", "mirrored", str(script)], tmp_path).stdout)
    assert (single["strategy"], single["replicas"]) == ("OneDeviceStrategy", 1)
    assert (launched["strategy"], launched["replicas"]) == ("MirroredStrategy", 2)
    assert len(single["losses"]) == 6  # 21 examples, global batch 8: 8, 8, 5 per epoch
    assert launched["losses"] == pytest.approx(single["losses"], abs=1e-5)
    for got, want in zip(launched["params"], single["params"]):
        assert got == pytest.approx(want, abs=1e-5)


def test_the_same_script_across_two_launchers_is_multi_worker_mirrored(script, single, tmp_path):
    # Two `towers launch` processes, one per "node" (both on this host), make one 2-replica job.
    from towers.launch import free_port

    port = str(free_port())
    launchers = [_start([sys.executable, "-m", "towers.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
                         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, str(script)],
                        tmp_path) for node in (0, 1)]
    chief, worker = _finish(launchers)
    assert "RESULT" not in worker.stdout  # only the chief prints
    launched = _result(chief.stdout)
    assert (launched["strategy"], launched["replicas"]) == ("MultiWorkerMirroredStrategy", 2)
    assert launched["losses"] == pytest.approx(single["losses"], abs=1e-5)
    for got, want in zip(launched["params"], single["params"]):
        assert got == pytest.approx(want, abs=1e-5)


def test_custom_loop_example_on_two_replicas(tmp_path):
    result = _run([sys.executable, "-m", "towers.cli", "launch", "--nproc-per-node", "2", str(EXAMPLE),
                   "--epochs", "2"], tmp_path)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("2 replica(s) with MirroredStrategy"), result.stdout
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"]  # printed once, by the chief
    accuracy = float(epochs[-1].split("test accuracy ")[1].split()[0])
    assert accuracy > 0.8
