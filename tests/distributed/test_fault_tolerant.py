"""FaultTolerantStrategy (torchft): its options and name, what a job without torchft or a lighthouse is told, a dead lighthouse.

A replica group SIGKILLed mid-training is tested where the same job (``tests/ft_job.py``) already
runs: tests/distributed/test_ft_launch.py (``towers launch --strategy ft`` restarts the lost group:
the survivor's next step within the bound, the restarted group healing, the collectives over both
groups after it, the same parameters as one device) and, with groups started by hand as in
docs/fault_tolerance.md's script, tests/distributed/test_ft_trainer.py.
"""

from __future__ import annotations

import sys
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
    from towers.strategies.fault_tolerant import FaultTolerantStrategy

    lighthouse, address = lighthouse_process(PEER_TIMEOUT_S)
    try:
        strategy = FaultTolerantStrategy(info=ProcessInfo(), lighthouse=address, peer_timeout_s=PEER_TIMEOUT_S,
                                         quorum_timeout_s=2.0)
        net = torch.nn.Linear(4, 2)
        model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

        def step(x: torch.Tensor) -> None:
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        strategy.run(step, args=(torch.ones(3, 4),))
        assert strategy.current_step == 1 and strategy.num_replicas_in_sync == 1
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
