"""One script, unchanged, under every strategy: the loop a user writes without towers is the reference.

``tests/one_script_job.py`` is written as a TensorFlow user writes one: ``GB = 16 *
strategy.num_replicas_in_sync``, ``distribute_dataset(..., shuffle=True, seed=0, num_workers=2)``, a
custom loop, then its ``Trainer.fit`` twin on a stream. It runs as ``python script.py`` and under
``towers launch`` with mirrored, sharded, ps (sync), hybrid (sync) and fault_tolerant, as a user
starts each job, on 2 replicas (the ps layouts: 2 workers and 1 ps task).

The reference is plain torch on one device, with no towers: a ``DataLoader`` over the same tensors
with ``DistributedSampler(num_replicas=1, shuffle=True, seed=0)`` and ``set_epoch`` (the order a DDP
user's sampler gives) at the run's global batch, ``F.cross_entropy`` as the mean, and for the stream a
``DataLoader`` over the ``IterableDataset``. Every strategy that promises one device's maths must give
its parameters (atol 1e-5, float32 sums in another order).

Where a strategy cannot honour an option it says so and the script takes the documented fix: the ps
strategy and the fault-tolerant one read each share in the training process (``--workers 0``), and the
fault-tolerant one takes map-style data only (``--fit-data map``); each refusal is asserted first. Async
parameter servers promise no one device's maths: the job completes and its example ledger proves every
example trained once per epoch (``towers verify --ledger`` exits 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from cli_support import run, towers_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import one_script_job as job  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(job.__file__).resolve()
DEADLINE_S = 150
ATOL = 1e-5


def _plain_loop(global_batch: int, *, stream: bool) -> dict[str, torch.Tensor]:
    """What a user gets on one device without towers, for the loop (map-style, shuffled) or the stream."""
    x, y = job.data()
    net = job.model()
    optimizer = job.optimizer_for(net)
    if stream:
        loader = DataLoader(job.Examples(), batch_size=global_batch)
        sampler = None
    else:
        sampler = DistributedSampler(TensorDataset(x, y), num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(TensorDataset(x, y), batch_size=global_batch, sampler=sampler)
    for epoch in range(job.EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            F.cross_entropy(net(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    return net.state_dict()


def _launch(tmp_path: Path, name: str, launch: list[str] | None, *script_args: str,
            phases: list[str] | None = None) -> dict:
    out = tmp_path / f"{name}.json"
    command = [sys.executable, str(SCRIPT)] if launch is None else [*towers_command(), "launch", *launch, str(SCRIPT)]
    done = run([*command, str(out), *script_args], cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(tmp_path))
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    for phase in phases or ("loop", "fit"):
        result[phase] = torch.load(f"{out}.{phase}.pt", weights_only=True)
    return result


def _assert_one_device(name: str, result: dict, *, fit_stream: bool = True) -> None:
    gb = result["global_batch"]
    assert gb == 16 * result["replicas"], (name, result["replicas"], gb)
    want_loop = _plain_loop(gb, stream=False)
    wanted = {"loop": want_loop, "fit": _plain_loop(gb, stream=True) if fit_stream else want_loop}
    for phase, want in wanted.items():
        if phase not in result:
            continue
        got = result[phase]
        assert got.keys() == want.keys(), (name, phase, sorted(got), sorted(want))
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst <= ATOL, (name, phase, worst)


#: name -> (towers launch arguments, script arguments); None: ``python script.py``.
SAME_MATHS = {
    "one_device": (None, ()),
    "mirrored": (["--nproc-per-node", "2", "--strategy", "mirrored"], ()),
    "sharded": (["--nproc-per-node", "2", "--strategy", "sharded"], ()),
    "hybrid": (["--nproc-per-node", "3", "--strategy", "hybrid", "--num-ps", "1", "--strategy-option", "mode=sync"],
               ()),
    "ps_sync": (["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=sync"],
                ("--workers", "0")),
    "fault_tolerant": (["--nproc-per-node", "2", "--strategy", "fault_tolerant", "--group-restarts", "0"],
                       ("--workers", "0", "--fit-data", "map", "--phases", "fit")),
}


@pytest.mark.parametrize("name", list(SAME_MATHS))
def test_one_script_gives_one_devices_parameters(tmp_path: Path, name: str) -> None:
    launch, script_args = SAME_MATHS[name]
    phases = script_args[script_args.index("--phases") + 1].split(",") if "--phases" in script_args else None
    result = _launch(tmp_path, name, launch, *script_args, phases=phases)
    assert result["replicas"] == (1 if launch is None else 2), result["replicas"]
    _assert_one_device(name, result, fit_stream="--fit-data" not in script_args)


def test_the_fault_tolerant_strategy_trains_the_first_model_and_refuses_a_second_one_loudly(tmp_path: Path) -> None:
    """A model prepared after the job committed steps would start its input at the job's step and would not heal
    on a group started again: the second phase is refused with the reason, and the first phase was exact."""
    launch = ["--nproc-per-node", "2", "--strategy", "fault_tolerant", "--group-restarts", "0"]
    out = tmp_path / "ft.json"
    done = run([*towers_command(), "launch", *launch, str(SCRIPT), str(out), "--workers", "0", "--fit-data", "map"],
               cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(tmp_path))
    assert done.returncode != 0, done.stdout[-2000:]
    assert "FaultTolerantStrategy trains the models prepared before its first step" in done.stderr + done.stdout
    assert "committed 6 step(s)" in done.stderr + done.stdout  # 2 epochs of 3 global batches
    want = _plain_loop(32, stream=False)
    got = torch.load(f"{out}.loop.pt", weights_only=True)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= ATOL


def test_async_parameter_servers_train_every_example_once(tmp_path: Path) -> None:
    """Async ps promises no one device's maths: the one script completes, and the ledger of its Trainer.fit proves
    that every example was trained once per epoch (``towers verify --ledger`` exits 0)."""
    ledger = tmp_path / "ledger"
    launch = ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--ledger", str(ledger)]
    result = _launch(tmp_path, "ps_async", launch, "--workers", "0", "--fit-data", "map")
    assert result["strategy"] == "ParameterServerStrategy" and result["replicas"] == 2
    proof = run([*towers_command(), "verify", "--ledger", str(ledger)], cwd=tmp_path, deadline_s=60,
                marker=str(tmp_path))
    assert proof.returncode == 0, proof.stdout + proof.stderr
    rows = [line.split() for line in proof.stdout.splitlines()]
    epochs = [r for r in rows if r and r[0].isdigit()]
    assert [(r[0], r[1], r[2], " ".join(r[5:])) for r in epochs] == [("0", "75", "75", "exactly once"),
                                                                   ("1", "75", "75", "exactly once")], proof.stdout
