"""Checkpoint files: round trip, RNG states, atomic writes (a killed writer), torn/foreign/incompatible files."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

from towers import checkpoint as ckpt
from towers.checkpoint import CheckpointError


def _state(value: float = 1.0) -> dict:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "step": 3, "global_step": 9,
            "data": {"epoch": 1, "examples": 48, "global_batch_size": 16, "seed": 0, "state": None},
            "rng": [ckpt.rng_state()], "strategy": "one_device", "num_replicas": 1}


def test_round_trip_with_weights_only(tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "a" / "c.pt", _state(2.0))
    loaded = ckpt.load_checkpoint(path)
    assert loaded["format"] == ckpt.FORMAT and loaded["version"] == ckpt.FORMAT_VERSION and loaded["kind"] == "full"
    assert torch.equal(loaded["model"]["weight"], torch.full((2, 3), 2.0))
    assert loaded["data"]["examples"] == 48 and loaded["optimizer"]["state"][0]["step"] == 1
    torch.load(path, weights_only=True)  # plain tensors and containers only
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]  # no temporary file left


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(7), random.random()
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def test_missing_file_and_missing_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        ckpt.load_checkpoint(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="lacks .* pass kind='user'"):
        ckpt.save_checkpoint(tmp_path / "x.pt", {"model": {}}, kind="full")


def test_torn_file_is_a_clear_error(tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "c.pt", _state())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"c\.pt cannot be read.*torn"):
        ckpt.load_checkpoint(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="cannot be read"):
        ckpt.load_checkpoint(path)


def test_foreign_and_newer_files(tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save(nn.Linear(2, 2).state_dict(), plain)
    with pytest.raises(CheckpointError, match=r"plain\.pt is not a towers checkpoint"):
        ckpt.load_checkpoint(plain)
    newer = tmp_path / "newer.pt"
    torch.save({**_state(), "format": ckpt.FORMAT, "version": ckpt.FORMAT_VERSION + 1, "kind": "full"}, newer)
    with pytest.raises(CheckpointError, match="format version 2.*Upgrade"):
        ckpt.load_checkpoint(newer)
    weights = ckpt.save_checkpoint(tmp_path / "w.pt", {"model": {}}, kind="weights")
    with pytest.raises(CheckpointError, match="only model weights"):
        ckpt.load_checkpoint(weights, kind="full")
    incomplete = tmp_path / "inc.pt"
    torch.save({"format": ckpt.FORMAT, "version": 1, "kind": "full", "model": {}}, incomplete)
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt.load_checkpoint(incomplete)


def test_model_mismatch_never_loads_partially():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 5)).state_dict()  # first layer fits, second does not
    with pytest.raises(CheckpointError, match=r"shape mismatches.*1\.weight"):
        ckpt.load_model_state(model, other, path="x.pt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointError, match="missing keys"):
        ckpt.load_model_state(model, {"0.weight": before["0.weight"]})


def test_crash_between_write_and_rename_keeps_previous(tmp_path, monkeypatch):
    path = ckpt.save_checkpoint(tmp_path / "c.pt", _state(1.0))

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.save_checkpoint(path, _state(5.0))
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def _blocked_writer(path: str, ready: mp.synchronize.Event) -> None:
    def half_then_block(state, f):
        import io

        buf = io.BytesIO()
        torch.save(dict(state), buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        ready.set()
        signal.pause()  # killed here, half-way through the write

    ckpt._serialize = half_then_block
    ckpt.save_checkpoint(path, _state(7.0))


def test_process_killed_during_write_leaves_previous_checkpoint(tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "c.pt", _state(1.0))
    ctx = mp.get_context("fork")  # the writer needs no fresh interpreter: fork is fast
    ready = ctx.Event()
    proc = ctx.Process(target=_blocked_writer, args=(str(path), ready))
    proc.start()
    try:
        assert ready.wait(30), "the writer never reached the middle of its write"
        tmp_files = [p for p in tmp_path.iterdir() if p.name != "c.pt"]
        assert tmp_files and tmp_files[0].stat().st_size > 0  # the new bytes went to a temporary file
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert zipfile.is_zipfile(path)
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 1.0))
    ckpt.save_checkpoint(path, _state(3.0))  # the next save succeeds and clears the stale temporary file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 3.0))
