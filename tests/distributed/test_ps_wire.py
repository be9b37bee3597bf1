"""A hostile peer on a parameter-server link: its pickle is never unpickled, the ps names the protocol error.

One worker slot and one ps task. The "worker" opens its link like a real one, then sends a
well-formed header whose JSON part is a pickle that would create a file when unpickled (and,
with ``bad_magic``, a header from another protocol). The ps must not create the file, must answer
with a protocol error, drop the link, and stop with a message that says why.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import towers
from towers.process_group import DistributedError
from towers.strategies.parameter_server import transport

pytestmark = pytest.mark.timeout(120)


class _Plant:
    """Unpickling this creates a file (what a hostile payload could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _hostile(path: str, bad_magic: bool) -> dict:
    strategy = towers.strategy_from_env(mode="async", timeout_s=20, exit_on_ps=False)
    if strategy.is_ps:
        try:
            strategy.ps_stats()
            return {"ps_error": None}
        except Exception as exc:  # pragma: no cover - ps_stats on a ps never raises
            return {"ps_error": repr(exc)}
    link = strategy._client.links[0]
    payload = pickle.dumps(_Plant(path), protocol=2)
    magic = 0x1234 if bad_magic else transport.MAGIC
    header = torch.tensor([magic, transport.Op.REGISTER, 0, len(payload), 0, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    link._group.send([header], link._peer, 0).wait()
    if not bad_magic:
        link._group.send([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], link._peer, 0).wait()
        reply = link.recv(timeout_s=20)
        out = {"status": reply.status, "reply": reply.meta}
    else:
        out = {"status": None, "reply": None}
    strategy._client.closed = True  # the ps dropped this link; nothing more to say
    return out


def _run_ps_side(path: str, bad_magic: bool) -> dict:
    try:
        return _hostile(path, bad_magic)
    except DistributedError as exc:
        return {"ps_error": str(exc)}


def test_hostile_peer_pickle_is_not_executed(tmp_path):
    # (a header from another protocol is refused before anything else is read: tests/unit/test_ps_tables.py)
    path, bad_magic = str(tmp_path / "planted"), False
    worker, ps = towers.spawn(_run_ps_side, 2, args=(path, bad_magic), timeout_s=90,
                              env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})
    assert not os.path.exists(path)  # the payload never ran, on the ps or anywhere
    assert "protocol error" in ps["ps_error"], ps
    if bad_magic:
        assert "not towers' parameter-server wire format 2" in ps["ps_error"]
    else:
        assert worker["status"] == transport.Status.BAD_INPUT
        assert "protocol error" in worker["reply"] and "not JSON" in worker["reply"], worker
