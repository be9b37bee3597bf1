"""Shared memory between a worker and a ps task: which files the ps maps, and the worker's fallback."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

from towers.strategies.parameter_server import shared, worker
from towers.strategies.parameter_server.shared import TOKEN_BYTES, attach, create, new_token

pytestmark = pytest.mark.skipif(not os.path.isdir(shared.SHARED_DIR), reason="no /dev/shm on this host")


def _with_token(nbytes: int = 256) -> tuple[shared.SharedBuffer, str]:
    buf, token = create(nbytes), new_token()
    buf.tensor[:TOKEN_BYTES] = torch.frombuffer(bytearray.fromhex(token), dtype=torch.uint8)
    return buf, token


def test_the_ps_side_sees_what_the_worker_writes_and_the_name_can_go():
    buf, token = _with_token()
    try:
        assert os.stat(buf.path).st_mode & 0o777 == 0o600
        other = attach(buf.path, 256, token)
        assert other is not None
        buf.tensor[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert other.tensor[100:104].tolist() == [1, 2, 3, 4]
        buf.unlink()
        assert not os.path.exists(buf.path)
        other.tensor[7] = 9  # still mapped on both sides once the name is gone
        assert int(buf.tensor[7]) == 9
        buf.unlink()  # idempotent
    finally:
        buf.unlink()


def test_attach_refuses_anything_but_the_offered_file(tmp_path):
    buf, token = _with_token()
    try:
        assert attach(buf.path, 255, token) is None  # another size
        assert attach(buf.path, 256, new_token()) is None  # another file's token
        assert attach(buf.path, 256, "zz" * TOKEN_BYTES) is None  # not hex
        assert attach(buf.path, 256, token[:-2]) is None
        assert attach(None, 256, token) is None
        assert attach(os.path.join(shared.SHARED_DIR, "passwd"), 256, token) is None  # not a towers name
        assert attach(buf.path + "0", 256, token) is None
        link = tmp_path / os.path.basename(buf.path)
        link.symlink_to(buf.path)
        assert attach(str(link), 256, token, directory=str(tmp_path)) is None  # a link is not followed
        elsewhere = create(256, directory=str(tmp_path))
        elsewhere.tensor[:TOKEN_BYTES] = buf.tensor[:TOKEN_BYTES]
        assert attach(elsewhere.path, 256, token, directory=str(tmp_path)) is not None
        assert attach(elsewhere.path, 256, token) is None  # a good file, outside the shared directory
        buf.unlink()
        assert attach(buf.path, 256, token) is None  # gone: another host would not see it either
    finally:
        buf.unlink()


def test_create_fails_loudly_where_there_is_no_room(tmp_path, monkeypatch):
    with pytest.raises(OSError):
        create(64, directory=str(tmp_path / "missing"))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space"):
        create(64, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing half-made is left


def _bound(shared_memory: bool) -> worker.BoundModel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return worker.BoundModel(model, client=None, num_ps=2, is_chief=True,  # type: ignore[arg-type]
                             optimizer=None, on_dead=lambda n: None, shared_memory=shared_memory)


def test_a_worker_offers_shared_buffers_its_parameters_live_in():
    bound = _bound(True)
    try:
        assert sorted(bound._offered) == bound.active == [0, 1]
        for p, (grads, params, token) in bound._offered.items():
            assert bound.param_bufs[p].data_ptr() == params.tensor.data_ptr()
            assert bound.grad_bufs[p].data_ptr() == grads.tensor.data_ptr()
            assert grads.tensor[:TOKEN_BYTES].tolist() == list(bytes.fromhex(token))
        views = {v.data_ptr() for vs in bound.param_views for v in vs}
        assert all(p.data_ptr() in views for p in bound.params)  # the model computes on the shared values
    finally:
        for grads, params, _ in bound._offered.values():
            grads.unlink()
            params.unlink()


def test_a_worker_without_room_keeps_to_the_wire(monkeypatch, caplog):
    calls = []

    def no_room(nbytes: int, directory: str = shared.SHARED_DIR) -> shared.SharedBuffer:
        calls.append(nbytes)
        if len(calls) == 3:  # the second shard's first file
            raise OSError(errno.ENOSPC, "No space left on device")
        return create(nbytes, directory)

    monkeypatch.setattr(worker, "create", no_room)
    with caplog.at_level("INFO", logger="towers"):
        bound = _bound(True)
    assert bound._offered == {} and len(calls) == 3
    assert "travel on the wire" in caplog.text
    pid = os.getpid()
    assert not [n for n in os.listdir(shared.SHARED_DIR) if n.startswith(f"towers-ps-{pid}-")]
    off = _bound(False)
    assert off._offered == {}


def test_a_worker_leaves_most_of_dev_shm_to_others(monkeypatch, caplog):
    monkeypatch.setattr(worker, "room", lambda directory=shared.SHARED_DIR: 1000)  # a nearly full /dev/shm
    with caplog.at_level("INFO", logger="towers"):
        bound = _bound(True)
    assert bound._offered == {}
    assert "--shm-size" in caplog.text and "free in /dev/shm" in caplog.text


def test_no_posix_fallocate_means_no_shared_memory(monkeypatch, tmp_path):
    monkeypatch.delattr(os, "posix_fallocate")
    with pytest.raises(OSError, match="posix_fallocate"):
        create(64, directory=str(tmp_path))


def test_files_of_dead_processes_are_swept_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(gone.stdout)  # exited and reaped: no such process now
    stale = tmp_path / f"towers-ps-{dead_pid}-{'a' * 32}"
    stale.write_bytes(b"x" * 64)
    mine = create(64, directory=str(tmp_path))  # this process: alive
    other = tmp_path / "towers-ps-notapid"
    other.write_bytes(b"y")
    assert shared.sweep(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and os.path.exists(mine.path) and other.exists()
    assert shared.sweep(str(tmp_path / "missing")) == []


def test_a_refused_registration_leaves_no_file():
    class Refusing:
        worker = 0

        def request(self, *args, **kwargs):
            raise ValueError("the chief's model differs")

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    bound = worker.BoundModel(model, client=Refusing(), num_ps=1, is_chief=False,  # type: ignore[arg-type]
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), on_dead=lambda n: None,
                              shared_memory=True)
    paths = [b.path for grads, params, _ in bound._offered.values() for b in (grads, params)]
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    with pytest.raises(ValueError, match="differs"):
        bound.register()
    assert not any(os.path.exists(p) for p in paths)


def test_a_host_without_dev_shm_keeps_to_the_wire_quietly(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(worker, "SHARED_DIR", str(tmp_path / "no-such-dir"))
    with caplog.at_level("INFO", logger="towers"):
        bound = _bound(True)
    assert bound._offered == {} and caplog.text == ""
