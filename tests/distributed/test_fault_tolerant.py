"""FaultTolerantStrategy (torchft): a replica group killed mid-training; the survivor goes on; the restarted one heals.

Two replica groups of one process each (``tests/ft_job.py``, a custom loop) and a lighthouse in
its own process, all on loopback. Group 1 is SIGKILLed after a few steps: group 0's next
committed step comes within the bound (about ``peer_timeout_s``). Group 1 is then started again
(this test plays the launcher) from other initial weights: it heals from group 0 at group 0's
step and both train together again. They stop after the same
step (the number the test writes once group 1 is back), end with equal parameters, exit 0, and
leave no process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_support import OutputReader, clean_env, start
from ft_job import done_step, one_device_reference
from ft_support import lighthouse_process, stop_all
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(120)

JOB = Path(__file__).resolve().parents[1] / "ft_job.py"
PEER_TIMEOUT_S = 2.0
#: What the issue allows at most between a kill and the survivor's next step (the knob's default bound).
BOUND_S = 10.0


def _step(line: str) -> tuple[int, int, float]:
    _, step, _, groups, _, t = line.split()
    return int(step), int(groups), float(t)


def test_survives_a_killed_group_and_heals_it(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    lighthouse, address = lighthouse_process(PEER_TIMEOUT_S)
    stop_file = tmp_path / "stop"
    env = clean_env({"RUST_LOG": "warn"})

    def group(gid: int, seed: int) -> OutputReader:
        argv = [sys.executable, str(JOB), address, str(gid), str(stop_file), str(tmp_path),
                "--peer-timeout-s", str(PEER_TIMEOUT_S), "--seed", str(seed)]
        return OutputReader(start(argv, cwd=tmp_path, env=env))

    readers: list[OutputReader] = []
    try:
        survivor, victim = group(0, seed=0), group(1, seed=1)
        readers += [survivor, victim]
        assert victim.wait_for_lines(5, "step", deadline_s=60), "group 1 took no 5 steps"
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed_at = time.time()
        victim_out, _ = victim.collect(timeout_s=10)
        victim_last = max(int(line.split()[1]) for line in victim_out.splitlines() if line.startswith("step"))

        # The survivor's next step that the killed group cannot have been part of (the one in flight may
        # still have completed with both): alone, or beyond the victim's last step + 1.
        survivor_next = None
        while survivor_next is None:
            lines = survivor.wait_for_lines(1, "step", deadline_s=BOUND_S + 5)
            assert lines, f"no step of the survivor within {BOUND_S + 5} s of the kill:\n{''.join(survivor._err[-30:])}"
            step, groups, t = _step(lines[0])
            if t > killed_at and (groups == 1 or step >= victim_last + 2):
                survivor_next = (step, t)
        assert survivor_next[1] - killed_at <= BOUND_S, f"next step {survivor_next[1] - killed_at:.1f} s after the kill"

        # Started again only now: a group that is starting (heartbeating, not yet asking for a quorum)
        # counts as live for the lighthouse, and with 2 groups its rule "a quorum needs more than half of
        # the live groups" makes the survivor wait for it (docs/fault_tolerance.md).
        restarted = group(1, seed=2)
        readers.append(restarted)
        back = restarted.wait_for_lines(1, "step", deadline_s=60)
        assert back, "the restarted group took no step"
        back_step, back_groups, _ = _step(back[0])
        assert back_step > victim_last + 1 and back_groups == 2, back[0]  # healed to the live step, in a quorum of two
        stop_file.touch()

        outs = {}
        for name, reader in (("survivor", survivor), ("restarted", restarted)):
            out, err = reader.collect(timeout_s=60)
            assert reader.proc.returncode == 0, f"{name} exited {reader.proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
            outs[name] = out
        stop_at = done_step("".join(outs.values()), 2)
        assert stop_at > back_step
        for out in outs.values():
            assert "collectives groups=[0, 1] sum=2.0 gathered=[0, 1, 1]" in out, out[-2000:]
        final = [torch.load(tmp_path / f"group{g}.pt") for g in (0, 1)]
        assert final[0].keys() == final[1].keys()
        for key in final[0]:
            assert torch.equal(final[0][key], final[1][key]), key
        # Same maths as one device: every committed step took its whole global batch, whoever was alive.
        reference = one_device_reference(stop_at)
        for key in final[0]:
            torch.testing.assert_close(final[0][key], reference[key], rtol=1e-4, atol=1e-5)
    finally:
        stop_all(readers, lighthouse, str(tmp_path))


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
