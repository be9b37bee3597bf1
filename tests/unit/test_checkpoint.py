"""Checkpoints on disk: round trip, RNG states, atomic publishing (a killed writer, a full disk), torn and foreign
checkpoints, nothing restored in part, two jobs in one directory, a read-only directory, a path that is a file."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from towers import checkpoint as ckpt
from towers.checkpoint import CheckpointError, layout
from towers.checkpoint.manager import DirectoryClaim


def _trained(value: float = 1.0, out: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, out)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return model, opt


def _save(path, value: float = 1.0):
    model, opt = _trained(value)
    return ckpt.save_checkpoint(path, {"model": model, "optimizer": opt, "epoch": 1, "rng": [ckpt.rng_state()]})


def _weight(path) -> torch.Tensor:
    return ckpt.load_checkpoint(path)["model"]["weight"]


def test_round_trip_reads_with_weights_only(tmp_path):
    path = _save(tmp_path / "a" / "c", 2.0)
    assert path.is_symlink() and sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "checksums.json", "state.pt"]
    loaded = ckpt.load_checkpoint(path)
    assert torch.equal(loaded["model"]["weight"], torch.full((2, 3), 2.0)) and loaded["epoch"] == 1
    # optimizer state is keyed by parameter name, so another strategy's numbering does not matter
    assert set(loaded["optimizer"]["state"]) == {"weight", "bias"}
    assert loaded["optimizer"]["param_groups"][0]["params"] == ["weight", "bias"]
    torch.load(path / "state.pt", weights_only=True)  # plain values only
    info = ckpt.checkpoint_info(path)
    assert info["strategy"] == "none" and info["num_replicas"] == 1 and "model" in info["keys"]
    assert [p.name for p in (tmp_path / "a").iterdir() if not p.name.startswith(".")] == ["c"]


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(7), random.random()
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def test_missing_torn_and_foreign(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        ckpt.load_checkpoint(tmp_path / "nope")
    path = _save(tmp_path / "c")
    data = sorted(path.glob("__*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"is damaged: its file __0_0\.distcp is 10 bytes.*truncated"):
        ckpt.load_checkpoint(path)
    (path / "state.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"is damaged: its file state\.pt is 23 bytes"):
        ckpt.load_checkpoint(path)
    plain = tmp_path / "plain.pt"
    torch.save(nn.Linear(2, 2).state_dict(), plain)
    with pytest.raises(CheckpointError, match=r"plain\.pt is not a towers checkpoint.*load_state_dict"):
        ckpt.load_checkpoint(plain)
    old = tmp_path / "old.pt"
    torch.save({"format": "towers.checkpoint", "version": 1, "kind": "full", "model": {}}, old)
    with pytest.raises(CheckpointError, match="older towers.*weights_only=True"):
        ckpt.load_checkpoint(old)
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match="folder is not a towers checkpoint"):
        ckpt.load_checkpoint(tmp_path / "folder")


def test_a_valid_checkpoint_is_never_called_torn(tmp_path):
    path = _save(tmp_path / "c")
    big, big_opt = _trained(out=5)  # another model: a fit error naming keys and shapes, not "torn"
    with pytest.raises(CheckpointError, match=r"does not fit this model: shape mismatches.*weight.*\(2, 3\).*\(5, 3\)") \
            as err:
        ckpt.restore_checkpoint(path, {"model": big, "optimizer": big_opt})
    assert "torn" not in str(err.value)
    ckpt.restore_checkpoint(path, {"model": _trained()[0]})  # and it still loads


def test_nothing_is_restored_in_part(tmp_path):
    model, opt = _trained(3.0)
    path = ckpt.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": opt})
    other = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"missing keys \['0.bias', '0.weight'\].*unexpected keys.*architecture"):
        ckpt.restore_checkpoint(path, {"model": other})
    fresh, fresh_opt = _trained(0.0)
    before = fresh.weight.clone()
    only_model = ckpt.save_checkpoint(tmp_path / "m", {"model": model})
    with pytest.raises(CheckpointError, match=r"has no \['optimizer'\]; it holds \['model'\]"):
        ckpt.restore_checkpoint(only_model, {"model": fresh, "optimizer": fresh_opt})
    no_state = ckpt.save_checkpoint(tmp_path / "n", {"model": model, "optimizer": None})
    with pytest.raises(CheckpointError, match="holds no optimizer state.*restart the optimizer from zero"):
        ckpt.restore_checkpoint(no_state, {"model": fresh, "optimizer": fresh_opt})
    assert torch.equal(fresh.weight, before)  # the model was not loaded either
    two_groups = torch.optim.Adam([{"params": [fresh.weight]}, {"params": [fresh.bias]}])
    with pytest.raises(CheckpointError, match=r"does not fit this optimizer: parameter groups of sizes \[2\].*\[1, 1\]"):
        ckpt.restore_checkpoint(path, {"model": fresh, "optimizer": two_groups})
    assert torch.equal(fresh.weight, before)


def test_a_killed_writer_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = _save(tmp_path / "c", 1.0)

    def crash(*args, **kwargs):
        raise OSError("simulated crash before publishing")

    monkeypatch.setattr(layout, "_publish", crash)
    with pytest.raises(OSError, match="simulated crash.*previous checkpoint at that path is intact"):
        _save(path, 5.0)
    monkeypatch.undo()
    assert torch.equal(_weight(path), torch.full((2, 3), 1.0))
    _save(path, 3.0)  # the next save succeeds and removes the unpublished directory
    assert torch.equal(_weight(path), torch.full((2, 3), 3.0))
    assert len([p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]) == 1


def _blocked_writer(path: str, ready) -> None:
    import torch.distributed.checkpoint as dcp

    def hang(*args, **kwargs):
        ready.set()
        signal.pause()  # killed here, in the middle of writing the tensors

    dcp.save = hang
    _save(path, 7.0)


def test_process_killed_during_write_leaves_previous_checkpoint(tmp_path):
    path = _save(tmp_path / "c", 1.0)
    ctx = mp.get_context("fork")  # the writer needs no fresh interpreter: fork is fast
    ready = ctx.Event()
    proc = ctx.Process(target=_blocked_writer, args=(str(path), ready))
    proc.start()
    try:
        assert ready.wait(30), "the writer never reached its write"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert torch.equal(_weight(path), torch.full((2, 3), 1.0))


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = _save(tmp_path / "c", 1.0)
    real = layout._save_file

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(layout, "_save_file", no_space)
    with pytest.raises(OSError, match="No space left on device.*free space.*previous checkpoint at that path is intact"):
        _save(path, 9.0)
    monkeypatch.setattr(layout, "_save_file", real)
    assert torch.equal(_weight(path), torch.full((2, 3), 1.0))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a small tmpfs needs root")
def test_a_really_full_filesystem_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this machine cannot mount a tmpfs (no privilege in this container)")
    try:
        path = _save(disk / "c", 1.0)  # a small model fits
        big = nn.Linear(300, 300)  # 360 kB of weights do not
        with pytest.raises(OSError, match=r"^No space left on device: .*c needs about 1 MB\..*previous checkpoint at that "
                                          "path is intact"):
            ckpt.save_checkpoint(path, {"model": big})
        assert torch.equal(_weight(path), torch.full((2, 3), 1.0))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_path_is_a_file_and_read_only_directory(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(CheckpointError, match="a file that towers did not write is there.*another path"):
        _save(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "mine"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions: a read-only bind of the folder is the same case
            pytest.skip("this user can write a read-only folder (root without a read-only mount)")
        with pytest.raises(OSError, match="Permission denied.*must be writable"):
            _save(ro / "c")
    finally:
        ro.chmod(0o700)


def test_read_only_directory_when_root_uses_a_read_only_mount(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("covered by test_path_is_a_file_and_read_only_directory for a non-root user")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True).returncode:
        pytest.skip("this machine cannot bind-mount (no privilege in this container)")
    try:
        with pytest.raises(OSError, match="Read-only file system.*must be writable"):
            _save(ro / "c")
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_two_jobs_cannot_write_one_directory(tmp_path):
    first = DirectoryClaim.acquire(tmp_path)
    assert DirectoryClaim.acquire(tmp_path) is first  # this process again (a notebook re-running fit): its own claim
    other = subprocess.run([sys.executable, "-c", "import sys; from towers.checkpoint.manager import DirectoryClaim; "
                            "DirectoryClaim.acquire(sys.argv[1])", str(tmp_path)], capture_output=True, text=True)
    assert other.returncode == 1
    assert f"Another job is writing checkpoints to {tmp_path} (pid {os.getpid()}" in other.stderr
    assert "its own directory" in other.stderr
    first.release()
    again = subprocess.run([sys.executable, "-c", "import sys; from towers.checkpoint.manager import DirectoryClaim; "
                            "DirectoryClaim.acquire(sys.argv[1])", str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr  # free once the first job is gone


def test_export_loads_into_the_plain_module_without_towers(tmp_path):
    model, _ = _trained(4.0)
    for name in ("m.safetensors", "m.pt"):
        path = ckpt.export_model(model, tmp_path / name)
        plain = nn.Linear(3, 2)
        if name.endswith(".pt"):
            plain.load_state_dict(torch.load(path, weights_only=True))
        else:
            from safetensors.torch import load_file

            plain.load_state_dict(load_file(str(path)))
        assert torch.equal(plain.weight, torch.full((2, 3), 4.0))
