"""FaultTolerantStrategy (torchft): its options and name, what a job without torchft or a lighthouse is told, a dead lighthouse,
and a group started again after the job ended on another node (it finds the end in the job's store and exits 0).

A replica group SIGKILLed mid-training is tested where the same job (``tests/ft_job.py``) already
runs: tests/distributed/test_ft_launch.py (``towers launch --strategy ft`` restarts the lost group:
the survivor's next step within the bound, the restarted group healing, the collectives over both
groups after it, the same parameters as one device) and, with groups started by hand as in
docs/fault_tolerance.md's script, tests/distributed/test_ft_trainer.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ft_support import lighthouse_process
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(120)

PEER_TIMEOUT_S = 2.0


def test_missing_torchft_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from towers.strategies.fault_tolerant import FaultTolerantStrategy

    monkeypatch.setitem(sys.modules, "torchft", None)  # what an environment without the extra sees
    with pytest.raises(ImportError, match=r"pip install 'towers\[ft\]'"):
        FaultTolerantStrategy(info=ProcessInfo(), lighthouse="http://127.0.0.1:1")


def test_options_are_checked_and_the_name_is_registered() -> None:
    import towers

    assert {"fault_tolerant", "ft", "torchft"} <= set(towers.strategies.strategy_names())
    with pytest.raises(ValueError, match="peer_timeout_s must be a positive number"):
        towers.get_strategy("ft", info=ProcessInfo(), lighthouse="http://127.0.0.1:1", peer_timeout_s=0)


def test_no_lighthouse_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from towers.strategies.fault_tolerant import FaultTolerantStrategy

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="needs the address of a torchft lighthouse"):
        FaultTolerantStrategy(info=ProcessInfo(), lighthouse=None)


def test_a_dead_lighthouse_stops_the_step_with_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from towers.launch.job_end import joined_noted
    from towers.strategies.fault_tolerant import FaultTolerantStrategy

    lighthouse, address = lighthouse_process(PEER_TIMEOUT_S)
    try:
        strategy = FaultTolerantStrategy(info=ProcessInfo(launch_dir=str(tmp_path)), lighthouse=address,
                                         peer_timeout_s=PEER_TIMEOUT_S, quorum_timeout_s=2.0)
        net = torch.nn.Linear(4, 2)
        model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step(x: torch.Tensor) -> None:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        assert not joined_noted(str(tmp_path), os.getpid())
        strategy.run(step, args=(torch.ones(3, 4),))
        assert strategy.current_step == 1 and strategy.num_replicas_in_sync == 1
        # A group of the job now: under towers launch its supervisor lets it end with the job (never stops it).
        assert joined_noted(str(tmp_path), os.getpid())
        lighthouse.kill()
        lighthouse.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no quorum from the lighthouse .* last committed step \(1\)"):
            strategy.run(step, args=(torch.ones(3, 4),))
        assert time.monotonic() - started < 30
        strategy.shutdown()
    finally:
        if lighthouse.poll() is None:
            lighthouse.kill()
            lighthouse.wait(timeout=10)


def test_the_first_step_waits_for_every_launched_group() -> None:
    """A group alone at the job's start does not train the job in a quorum of its own (it would end with other
    parameters than the groups that come later): its first step waits for the launched groups, then says so."""
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from towers.strategies.fault_tolerant import FaultTolerantStrategy

    lighthouse, address = lighthouse_process(PEER_TIMEOUT_S)
    try:  # group 0 of a job of 2 groups; group 1 never comes
        strategy = FaultTolerantStrategy(info=ProcessInfo(rank=0, world_size=2), lighthouse=address,
                                         peer_timeout_s=PEER_TIMEOUT_S, quorum_timeout_s=1.0)
        net = torch.nn.Linear(4, 2)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step(x: torch.Tensor) -> None:
            model(x).sum().backward()
            optimizer.step()

        with pytest.raises(RuntimeError, match=r"first step needs all 2 launched replica groups.*group\(s\) \[0\]"):
            strategy.run(step, args=(torch.ones(3, 4),))
        assert strategy.current_step == 0
        assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
        strategy.shutdown()
    finally:
        lighthouse.kill()
        lighthouse.wait(timeout=10)


def test_a_group_started_again_after_the_job_ended_on_another_node_exits_0(caplog: pytest.LogCaptureFixture) -> None:
    """A group on another node than the groups that ended the job reads the job's store (its supervisor has no
    note of the end): before its first quorum, and while its first step waits for the launched groups."""
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from datetime import timedelta

    from torch.distributed import TCPStore

    from towers.launch.job_end import JobComplete, note_job_complete
    from towers.strategies.fault_tolerant import FaultTolerantStrategy

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))  # torchrun's
    # Group 1 of 2, one group per node (world_size 2, local_world_size 1), under torchrun's agent store.
    info = ProcessInfo(rank=1, world_size=2, agent_store=True, master_port=store.port)
    lighthouse, address = lighthouse_process(PEER_TIMEOUT_S)
    waiting = threading.Event()

    class _Waits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for all 2 launched replica groups" in record.getMessage():
                waiting.set()

    handler = _Waits()
    logging.getLogger("towers").addHandler(handler)
    try:
        strategy = FaultTolerantStrategy(info=info, lighthouse=address, peer_timeout_s=PEER_TIMEOUT_S,
                                         quorum_timeout_s=30.0)
        net = torch.nn.Linear(4, 2)
        model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step(x: torch.Tensor) -> None:
            model(x).sum().backward()
            optimizer.step()

        def end_the_job() -> None:  # group 0's supervisor, on the other node, once this group waits for it
            if waiting.wait(timeout=20):
                note_job_complete(dataclasses.replace(info, rank=0), 0)

        ender = threading.Thread(target=end_the_job, daemon=True)
        ender.start()
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="towers"), pytest.raises(JobComplete) as raised:
            strategy.run(step, args=(torch.ones(3, 4),))
        assert raised.value.code == 0 and raised.value.end.group == 0 and waiting.is_set()
        assert time.monotonic() - started < 15  # not quorum_timeout_s
        lines = [r.getMessage() for r in caplog.records if "found the job complete" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("replica group 1 found the job complete: replica group 0 "
                                                       "ended the job's training"), lines
        # Started after the end: it says so before it asks for any quorum.
        again = FaultTolerantStrategy(info=info, lighthouse=address, peer_timeout_s=PEER_TIMEOUT_S)
        net = torch.nn.Linear(4, 2)
        model, optimizer = again.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.raises(JobComplete):
            again.run(step, args=(torch.ones(3, 4),))
    finally:
        logging.getLogger("towers").removeHandler(handler)
        lighthouse.kill()
        lighthouse.wait(timeout=10)
