"""A stream of files trains the same model on 1 and 2 Mirrored replicas, and a job stopped at 2 resumes at 1.

(The custom loop, and ``Trainer.fit``/``evaluate`` on the same stream.)

The input is three text files of different lengths read through ``towers.data.Shards`` (a reader
that yields lines, a transform that parses them). Two epochs on 2 replicas give the one-device
parameters; a 2-replica run stopped after 3 global batches writes a checkpoint (model, optimizer,
stream position) and one device finishes the job from it with the uninterrupted job's parameters.
In the same launch each replica then reads its own copy of the files, one of which differs: both
replicas stop at the epoch's start with the same ``ShardChangedError``, not with a desynchronised
batch count.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.data import ShardChangedError, Shards
from towers.diagnostics.throughput import THROUGHPUT_KEYS

pytestmark = pytest.mark.timeout(120)

ATOL = 1e-6
GLOBAL_BATCH = 6
EPOCHS = 2
STOP_AFTER = 3  # global batches of epoch 0 trained before the 2-replica job stops


def _write_files(folder: Path) -> list[str]:
    g = torch.Generator().manual_seed(0)
    paths = []
    for i, n in enumerate((9, 4, 12)):  # 25 examples: a ragged last batch of 1
        x = torch.randn(n, 3, generator=g)
        y = (x.sum(1) > 0).long()
        path = folder / f"part-{i}.csv"
        path.write_text("".join(f"{a:.6f},{b:.6f},{c:.6f},{int(t)}\n" for (a, b, c), t in zip(x.tolist(), y)))
        paths.append(str(path))
    return paths


def _read_lines(path: str) -> Any:
    with open(path) as f:
        yield from f


def _parse(line: str) -> tuple[torch.Tensor, torch.Tensor]:
    *x, y = line.strip().split(",")
    return torch.tensor([float(v) for v in x]), torch.tensor(int(y))


def _train(strategy: towers.Strategy, paths: list[str], *, stop_after: int | None = None,
           checkpoint: dict[str, Any] | None = None) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Train EPOCHS epochs (or stop after ``stop_after`` batches); return the parameters and a checkpoint."""
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9)
    model, optimizer = strategy.prepare(net, optimizer)
    batches = strategy.distribute_dataset(Shards(paths, _read_lines, transform=_parse), GLOBAL_BATCH, seed=7,
                                          shuffle_block=4)
    if checkpoint is not None:
        strategy.unwrap(model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        batches.load_state_dict(checkpoint["stream"])

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    trained = 0
    while batches.epoch < EPOCHS:
        for x, y in batches:
            strategy.run(step, args=(x, y))
            trained += 1
            if trained == stop_after:
                state = {"model": strategy.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                         "stream": batches.state_dict()}
                return [p.detach().clone() for p in strategy.unwrap(model).parameters()], state
    return [p.detach().clone() for p in strategy.unwrap(model).parameters()], {}


def _fit(strategy: towers.Strategy, paths: list[str]) -> dict[str, Any]:
    """Trainer.fit on the stream, validated on it: parameters, History and evaluate's logs."""
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9)
    trainer = towers.Trainer(net, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    stream = Shards(paths, _read_lines, transform=_parse)
    history = trainer.fit(stream, EPOCHS, GLOBAL_BATCH, validation_data=stream)
    return {"params": [p.detach().clone() for p in trainer.unwrapped_model.parameters()],
            "history": history.history, "evaluate": trainer.evaluate(stream, 4)}


def _first_batch_of_own_copy(strategy: towers.Strategy, copies: list[list[str]]) -> str:
    """Read the first batch of this replica's copy of the files; return the error it raised (or "no error")."""
    batches = strategy.distribute_dataset(Shards(copies[strategy.replica_id], _read_lines, transform=_parse),
                                          GLOBAL_BATCH, seed=7)
    try:
        next(iter(batches))
    except ShardChangedError as exc:
        return str(exc)
    return "no error"


def _replica(paths: list[str], copies: list[list[str]]) -> dict[str, Any]:
    full, _ = _train(towers.MirroredStrategy(timeout_s=60), paths)
    _, checkpoint = _train(towers.MirroredStrategy(timeout_s=60), paths, stop_after=STOP_AFTER)
    strategy = towers.MirroredStrategy(timeout_s=60)
    fit = _fit(strategy, paths)
    return {"full": full, "checkpoint": checkpoint, "fit": fit, "copies": _first_batch_of_own_copy(strategy, copies)}


def test_a_file_stream_trains_the_one_device_model_and_resumes_from_2_replicas_on_1(tmp_path):
    paths = _write_files(tmp_path)
    (tmp_path / "host-1").mkdir()
    copies = [paths, [shutil.copy(p, tmp_path / "host-1") for p in paths]]
    with open(copies[1][1], "a") as f:  # the second host's copy of part-1 has one more line
        f.write("0.5,0.5,0.5,1\n")
    per_rank = towers.spawn(_replica, 2, args=(paths, copies), timeout_s=90)
    reference, _ = _train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()), paths)
    for rank, result in enumerate(per_rank):
        for got, want in zip(result["full"], reference):
            assert torch.allclose(got, want, atol=ATOL), (rank, (got - want).abs().max())
    checkpoint = per_rank[0]["checkpoint"]
    assert checkpoint["stream"] == per_rank[1]["checkpoint"]["stream"]
    assert checkpoint["stream"]["examples"] == STOP_AFTER * GLOBAL_BATCH
    resumed, _ = _train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()), paths, checkpoint=checkpoint)
    for got, want in zip(resumed, reference):
        assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    # Trainer.fit and evaluate on the same stream (its length unknown until its end): one device's History
    fitted = _fit(towers.OneDeviceStrategy("cpu", info=ProcessInfo()), paths)
    assert fitted["history"]["examples"] == [25.0, 25.0] and fitted["evaluate"]["examples"] == 25.0
    assert fitted["history"]["loss"][1] < fitted["history"]["loss"][0]
    for result in per_rank:
        for got, want in zip(result["fit"]["params"], fitted["params"]):
            assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
        for key, values in fitted["history"].items():
            if key in THROUGHPUT_KEYS:  # measured: differs run to run
                continue
            assert result["fit"]["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
        assert result["fit"]["evaluate"] == pytest.approx(fitted["evaluate"], rel=1e-5)
    for rank, result in enumerate(per_rank):  # every replica stops, with the same named error
        assert result["copies"].startswith(f"[rank {rank}/2] The replicas see different files for shard 1 ("), (
            rank, result["copies"])
        assert "part-1.csv) at the start of epoch 0: its size is" in result["copies"]

