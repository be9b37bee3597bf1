"""Fault injection into published checkpoints: every damaged file is one named error; nothing loads in silence.

Each fault comes from a seeded generator (a file, an offset, bytes), so a failure reproduces. The
reference is plain torch: an intact checkpoint gives back the tensors the model held.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers import checkpoint as ckpt
from towers.checkpoint import CheckpointError, CheckpointManager, CorruptCheckpointError, integrity, layout

TRIES = 8
FILES = [".metadata", "__0_0.distcp", "checksums.json", "state.pt"]


def _trained(value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return model, opt


def _save(path, value: float = 1.0) -> Path:
    model, opt = _trained(value)
    return ckpt.save_checkpoint(path, {"model": model, "optimizer": opt, "epoch": 1, "rng": [ckpt.rng_state()]})


def _flip(file: Path, rng: random.Random, n: int = 16) -> None:
    """Change ``n`` consecutive bytes at a random offset (each XOR a non-zero byte: every one differs)."""
    data = bytearray(file.read_bytes())
    start = rng.randrange(0, len(data) - n)
    for i in range(start, start + n):
        data[i] ^= rng.randrange(1, 256)
    file.write_bytes(bytes(data))


def _expect_damaged(path: Path, name: str, cause: str) -> str:
    """Every way of reading ``path`` raises one CorruptCheckpointError naming it, ``name`` and the fix."""
    model, opt = _trained(0.0)
    before = model.weight.clone()
    messages = []
    for read in (lambda: ckpt.load_checkpoint(path), lambda: ckpt.restore_checkpoint(path, {"model": model, "optimizer": opt})):
        with pytest.raises(CorruptCheckpointError) as err:
            read()
        messages.append(str(err.value))
    assert torch.equal(model.weight, before)  # nothing restored in part
    for message in messages:
        assert f"Checkpoint {path} is damaged: its file {name} {cause}" in message, message
        assert "Restore an older checkpoint" in message and "\n" not in message
    return messages[0]


def test_flipped_bytes_in_any_file_are_one_named_error(tmp_path):
    rng = random.Random(1234)
    path = _save(tmp_path / "c", 2.0)
    assert sorted(os.listdir(path)) == sorted(FILES)
    pristine = {name: (path / name).read_bytes() for name in FILES}
    for _ in range(TRIES):
        name = rng.choice(FILES)
        _flip(path / name, rng)
        cause = "does not match its own checksum" if name == integrity.DIGESTS else "does not match the SHA-256"
        _expect_damaged(path, name, cause)
        (path / name).write_bytes(pristine[name])
    # every file once more, whatever the draws picked
    for name in FILES:
        _flip(path / name, rng)
        with pytest.raises(CorruptCheckpointError, match=f"its file {name} "):
            ckpt.load_checkpoint(path)
        (path / name).write_bytes(pristine[name])
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 2.0))


def test_truncated_empty_and_missing_files_are_one_named_error(tmp_path):
    rng = random.Random(99)
    path = _save(tmp_path / "c")
    pristine = {name: (path / name).read_bytes() for name in FILES}
    for _ in range(TRIES):
        name = rng.choice([n for n in FILES if n != integrity.DIGESTS])
        size = len(pristine[name])
        (path / name).write_bytes(pristine[name][:rng.randrange(1, size)])
        _expect_damaged(path, name, "is ")  # "is N bytes; M were written (truncated)"
        assert "truncated" in str(pytest.raises(CorruptCheckpointError, ckpt.load_checkpoint, path).value)
        (path / name).write_bytes(b"")
        _expect_damaged(path, name, "is empty (0 bytes")
        (path / name).write_bytes(pristine[name])
    for name in (".metadata", "__0_0.distcp", "state.pt", integrity.DIGESTS):
        (path / name).unlink()
        _expect_damaged(path, name, "is missing")
        (path / name).write_bytes(pristine[name])
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 1.0))


def _as_written_without_checksums(path: Path) -> None:
    """Make ``path`` what an older towers wrote: no checksums.json, no mention of it in state.pt."""
    (path / integrity.DIGESTS).unlink()
    state = torch.load(path / "state.pt", weights_only=True)
    del state["checksums"]
    torch.save(state, path / "state.pt")


def test_older_checkpoints_without_checksums_load_and_name_a_damaged_file(tmp_path, caplog):
    path = _save(tmp_path / "c", 4.0)
    _as_written_without_checksums(path)
    with caplog.at_level(logging.INFO, logger="towers"):
        loaded = ckpt.load_checkpoint(path)
    assert torch.equal(loaded["model"]["weight"], torch.full((2, 3), 4.0))
    assert [r.getMessage() for r in caplog.records if "cannot be verified" in r.getMessage()] == [
        f"checkpoint {path} was written without checksums (by an older towers): its files cannot be verified"]
    pristine = {name: (path / name).read_bytes() for name in ("state.pt", ".metadata", "__0_0.distcp")}
    rng = random.Random(7)
    for name, cause in (("state.pt", "cannot be parsed"), (".metadata", "cannot be parsed"),
                        ("__0_0.distcp", "cannot be read")):
        (path / name).write_bytes(pristine[name][:rng.randrange(1, len(pristine[name]) // 2)])
        _expect_damaged(path, name, cause)
        (path / name).write_bytes(pristine[name])
    (path / "state.pt").write_bytes(b"")
    _expect_damaged(path, "state.pt", "is empty")
    (path / "state.pt").write_bytes(pristine["state.pt"])
    (path / ".metadata").unlink()
    _expect_damaged(path, ".metadata", "is missing")


def test_manager_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    rng = random.Random(5)
    manager = CheckpointManager(tmp_path, max_to_keep=None, preemption=False)
    for value in (1.0, 2.0, 3.0):
        model, opt = _trained(value)
        manager.save({"model": model, "optimizer": opt, "value": value})
    newest = manager.latest_checkpoint
    damaged = rng.choice(FILES)
    _flip(newest / damaged, rng)
    model, opt = _trained(0.0)
    with caplog.at_level(logging.WARNING, logger="towers"):
        state = manager.restore({"model": model, "optimizer": opt})
    assert state["value"] == 2.0 and torch.equal(model.weight.detach(), torch.full((2, 3), 2.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"Checkpoint {newest} is damaged: its file {damaged}" in warnings[0]
    assert f"Falling back to the previous checkpoint, {tmp_path / 'ckpt-1'}" in warnings[0]
    with pytest.raises(CorruptCheckpointError, match=f"its file {damaged}"):  # a path named: no fallback
        manager.restore({"model": model}, path=newest)
    for older in manager.checkpoints[:-1]:
        (older / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=f"No intact checkpoint in {tmp_path}: all 3 are damaged"):
        manager.restore({"model": model})
    manager.close()


@pytest.mark.parametrize("damage", ["state.pt deleted", "folder deleted"])
def test_manager_passes_over_a_checkpoint_without_its_files_with_a_warning_too(tmp_path, caplog, damage):
    manager = CheckpointManager(tmp_path, max_to_keep=None, preemption=False)
    for value in (1.0, 2.0):
        model, opt = _trained(value)
        manager.save({"model": model, "optimizer": opt, "value": value})
    newest = manager.latest_checkpoint
    if damage == "state.pt deleted":
        (newest / "state.pt").unlink()
    else:  # the link stays, the folder it points to is gone
        shutil.rmtree(newest.resolve())
    model, opt = _trained(0.0)
    with caplog.at_level(logging.WARNING, logger="towers"):
        state = manager.restore({"model": model, "optimizer": opt})
    assert state["value"] == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0], warnings
    assert ("its file state.pt is missing" if damage == "state.pt deleted" else "points to a directory that is gone") \
        in warnings[0]
    assert f"Falling back to the previous checkpoint, {tmp_path / 'ckpt-0'}" in warnings[0]
    (tmp_path / "ckpt-0" / "state.pt").unlink()  # nothing intact left: an error, not a fresh start
    with pytest.raises(CorruptCheckpointError, match=f"No intact checkpoint in {tmp_path}: all 2 are damaged"):
        manager.restore({"model": model})
    manager.close()


def test_backup_and_restore_refuses_a_damaged_backup(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()

    def trainer() -> towers.Trainer:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                              strategy=towers.OneDeviceStrategy("cpu"))

    trainer().fit((x, y), 1, 8, callbacks=[towers.callbacks.BackupAndRestore(tmp_path, save_freq=2,
                                                                             delete_checkpoint=False)])
    _flip(tmp_path / "backup" / "__0_0.distcp", random.Random(3))
    with pytest.raises(CorruptCheckpointError, match="its file __0_0.distcp does not match"):
        trainer().fit((x, y), 1, 8, callbacks=[towers.callbacks.BackupAndRestore(tmp_path)])
    (tmp_path / "backup" / "state.pt").unlink()  # not a fresh start in silence either
    with pytest.raises(CorruptCheckpointError, match="its file state.pt is missing"):
        trainer().fit((x, y), 1, 8, callbacks=[towers.callbacks.BackupAndRestore(tmp_path)])


def test_a_full_disk_says_how_much_space_is_needed(tmp_path, monkeypatch):
    path = _save(tmp_path / "c", 1.0)
    big = nn.Linear(1000, 500)  # 2.0 MB of weights
    real_write = integrity.HashingFile.write

    def fills_up(self, data):
        if self.size > 100_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(integrity.HashingFile, "write", fills_up)  # every checkpoint file is written through it
    with pytest.raises(OSError, match=rf"^No space left on device: {path} needs about 2 MB\. .*previous checkpoint") as err:
        ckpt.save_checkpoint(path, {"model": big})
    assert err.value.errno == errno.ENOSPC
    monkeypatch.undo()

    def torch_full_disk(*args, **kwargs):  # what torch.save raises when the disk fills under it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(layout, "_save_file", torch_full_disk)
    with pytest.raises(OSError, match=rf"^No space left on device: {path} needs about 1 MB"):
        ckpt.save_checkpoint(path, {"model": nn.Linear(3, 2), "extra": torch.zeros(10)})
    monkeypatch.undo()
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["weight"], torch.full((2, 3), 1.0))


def test_a_checkpoint_copied_elsewhere_still_verifies(tmp_path):
    path = _save(tmp_path / "c", 5.0)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # the checksums are per file name: a copied directory loads anywhere
    assert torch.equal(ckpt.load_checkpoint(copy)["model"]["weight"], torch.full((2, 3), 5.0))
    assert isinstance(CorruptCheckpointError("x"), CheckpointError)
