"""Invariant 2 (same script): one file runs unchanged as ``python script.py`` (one replica) and under
``towers launch --nproc-per-node 2 --strategy mirrored`` (two replicas), and across two launchers
(``--nnodes 2``: MultiWorkerMirroredStrategy), with the same final parameters and losses, printed
once (by the chief). Also the custom-loop example, end to end.

Every command runs in a new session with a deadline; on timeout the whole process group is killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_support import finish, run, start

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


def _succeeded(results: list[subprocess.CompletedProcess]) -> list[subprocess.CompletedProcess]:
    for r in results:
        assert r.returncode == 0, f"{' '.join(r.args)} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return results


def _run(argv: list[str], cwd: Path, marker: Path) -> subprocess.CompletedProcess:
    return _succeeded([run(argv, cwd=cwd, deadline_s=DEADLINE_S, marker=str(marker))])[0]


def _result(stdout: str) -> dict:
    # towers launch prefixes each worker's line with "[rank N]: "
    lines = [line.split("]: ", 1)[-1] for line in stdout.splitlines() if line.split("]: ", 1)[-1].startswith("RESULT ")]
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
    return _result(_run([sys.executable, str(script)], script.parent, script).stdout)


def test_one_script_runs_unchanged_on_one_and_two_replicas(script, single, tmp_path):
    launched = _result(_run([sys.executable, "-m", "towers.cli", "launch", "--nproc-per-node", "2",
                             "--strategy", "mirrored", str(script)], tmp_path, script).stdout)
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
    launchers = [start([sys.executable, "-m", "towers.cli", "launch", "--nnodes", "2", "--node-rank", str(node),
                         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port, str(script)],
                       cwd=tmp_path) for node in (0, 1)]
    chief, worker = _succeeded(finish(launchers, deadline_s=DEADLINE_S, marker=str(script)))
    assert "RESULT" not in worker.stdout  # only the chief prints
    launched = _result(chief.stdout)
    assert (launched["strategy"], launched["replicas"]) == ("MultiWorkerMirroredStrategy", 2)
    assert launched["losses"] == pytest.approx(single["losses"], abs=1e-5)
    for got, want in zip(launched["params"], single["params"]):
        assert got == pytest.approx(want, abs=1e-5)


def test_custom_loop_example_on_two_replicas(tmp_path):
    result = _run([sys.executable, "-m", "towers.cli", "launch", "--nproc-per-node", "2", str(EXAMPLE),
                   "--epochs", "2"], tmp_path, EXAMPLE)
    lines = [line.split("]: ", 1)[-1] for line in result.stdout.splitlines()]  # without "[rank N]: "
    assert lines[0].startswith("2 replica(s) with MirroredStrategy"), result.stdout
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"]  # printed once, by the chief
    accuracy = float(epochs[-1].split("test accuracy ")[1].split()[0])
    assert accuracy > 0.8
