"""Trainer.fit under FaultTolerantStrategy: a group killed mid-epoch, the survivor trains on, the restarted one follows the job.

Two replica groups of one process each run ``tests/ft_trainer_job.py`` (an unchanged
``Trainer.fit`` script, 3 epochs of 16 steps) with torchft's lighthouse in its own process. Group 1
is SIGKILLed in epoch 0; group 0 trains on alone up to global step 20 (epoch 1) and holds there
until group 1, started again from other weights, is built. Group 1 then heals to the job's step and
its Trainer continues in epoch 1 at the step it joins (not at epoch 0): both finish the same 48 steps with
bitwise equal parameters and optimizer state (momentum), the parameters those of one device running the
same steps, and the survivor's History counts every example of each epoch once. The ledger the groups
kept proves the same: each example of each epoch trained exactly once, through the kill, the lone steps
and the join.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from cli_support import OutputReader, clean_env, start
from ft_support import lighthouse_process, stop_all
from towers.ledger import prove_ledger

pytestmark = pytest.mark.timeout(120)

JOB = Path(__file__).resolve().parents[1] / "ft_trainer_job.py"
PEER_TIMEOUT_S = 2.0
EPOCHS, STEPS_PER_EPOCH = 3, 16
HOLD_AT = 20  # epoch 1, batch 4: the restarted group must join mid-epoch


def _steps(out: str) -> list[tuple[int, int, int]]:
    """``(global step, epoch, groups)`` of each ``step`` line."""
    rows = []
    for line in out.splitlines():
        if line.startswith("step "):
            _, step, _, epoch, _, groups = line.split()
            rows.append((int(step), int(epoch), int(groups)))
    return rows


def _one_device_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The job's fit on one device (OneDeviceStrategy): its parameters and History examples."""
    import towers
    from ft_trainer_job import GLOBAL_BATCH_SIZE, dataset, model_and_optimizer

    net, optimizer = model_and_optimizer(0)  # group 0's initial weights: the job's
    trainer = towers.Trainer(net, optimizer, loss=torch.nn.functional.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"))
    history = trainer.fit(dataset(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH_SIZE)
    assert trainer.progress.global_step == EPOCHS * STEPS_PER_EPOCH
    return net.state_dict(), history["examples"]


def test_fit_goes_on_and_a_restarted_group_continues_in_the_jobs_epoch(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from ft_trainer_job import NUM_EXAMPLES

    lighthouse, address = lighthouse_process(PEER_TIMEOUT_S)
    gate = tmp_path / "gate"
    env = clean_env({"RUST_LOG": "warn"})

    def group(gid: int, seed: int, *extra: str) -> OutputReader:
        argv = [sys.executable, str(JOB), address, str(gid), str(tmp_path), "--peer-timeout-s", str(PEER_TIMEOUT_S),
                "--seed", str(seed), "--epochs", str(EPOCHS), "--ledger", str(tmp_path / "run"), *extra]
        return OutputReader(start(argv, cwd=tmp_path, env=env))

    readers: list[OutputReader] = []
    try:
        survivor = group(0, 0, "--hold-at", str(HOLD_AT), "--gate", str(gate))
        victim = group(1, 1)
        readers += [survivor, victim]
        assert victim.wait_for_lines(5, "step", deadline_s=60), "group 1 took no 5 steps"
        os.kill(victim.proc.pid, signal.SIGKILL)  # in epoch 0 (steps 0-15)
        victim_out, _ = victim.collect(timeout_s=10)
        victim_last = max(step for step, _, _ in _steps(victim_out))
        assert victim_last < STEPS_PER_EPOCH, victim_out

        held = survivor.wait_for_lines(1, "holding", deadline_s=60)
        assert held == [f"holding at {HOLD_AT}\n"], f"the survivor did not reach step {HOLD_AT}:\n{''.join(survivor._err[-30:])}"

        # Started again only now (with 2 groups a starting group makes a lone survivor wait: docs/fault_tolerance.md);
        # the survivor goes on once the restarted group is built, so the job cannot end without it.
        restarted = group(1, 2)
        readers.append(restarted)
        assert restarted.wait_for_lines(1, "ready", deadline_s=60), "the restarted group did not start"
        tmp = gate.with_suffix(".tmp")
        tmp.write_text("open")
        tmp.replace(gate)

        outs = {}
        for name, reader in (("survivor", survivor), ("restarted", restarted)):
            out, err = reader.collect(timeout_s=60)
            assert reader.proc.returncode == 0, f"{name} exited {reader.proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
            outs[name] = out
        summaries = {g: json.loads((tmp_path / f"group{g}.json").read_text()) for g in (0, 1)}

        last = EPOCHS * STEPS_PER_EPOCH
        survivor_steps = _steps(outs["survivor"])
        assert [s for s, _, _ in survivor_steps] == list(range(1, last + 1))  # each committed step once, in order
        # The restarted group joins at the first quorum it asks for: the step after the hold, or (when the
        # survivor's request reaches the lighthouse first, under load) one of the next few.
        first_step, first_epoch, groups = _steps(outs["restarted"])[0]
        assert HOLD_AT < first_step <= HOLD_AT + 3 and groups == 2, outs["restarted"]
        assert first_epoch == (first_step - 1) // STEPS_PER_EPOCH == HOLD_AT // STEPS_PER_EPOCH, outs["restarted"]
        alone = [s for s, _, groups in survivor_steps if groups == 1 and s > victim_last + 1]
        assert alone and max(alone) < first_step, survivor_steps  # it trained on alone after the kill, until the join
        assert all(groups == 2 for s, _, groups in survivor_steps if s >= first_step), survivor_steps

        # History: the survivor's has every epoch, each counting every example once (retried steps included);
        # the restarted group's starts at the epoch it joined, which the job completed.
        assert summaries[0]["epochs"] == list(range(EPOCHS))
        assert summaries[0]["history"]["examples"] == [float(NUM_EXAMPLES)] * EPOCHS
        assert summaries[1]["epochs"] == list(range(first_epoch, EPOCHS))
        assert summaries[1]["history"]["examples"] == [float(NUM_EXAMPLES)] * len(summaries[1]["epochs"])
        for summary in summaries.values():
            assert summary["global_step"] == summary["job_step"] == last, summary

        final = [torch.load(tmp_path / f"group{g}.pt") for g in (0, 1)]
        moments = [torch.load(tmp_path / f"group{g}.optimizer.pt") for g in (0, 1)]
        assert sorted(moments[0]) == sorted(moments[1]) == sorted(f"{k}.momentum_buffer" for k in final[0])
        for state in (final, moments):  # replicas: bitwise the same parameters and optimizer state, as under Mirrored
            unequal = [key for key in state[0] if not torch.equal(state[0][key], state[1][key])]
            assert not unequal, [(k, float((state[0][k] - state[1][k]).abs().max())) for k in unequal]
        reference, examples = _one_device_reference()
        assert examples == summaries[0]["history"]["examples"]
        for key in final[0]:  # the same maths as one device: every committed step took its whole global batch
            torch.testing.assert_close(final[0][key], reference[key], rtol=1e-4, atol=1e-5)
        # The ledger the groups kept (each committed share; the restarted group joined, rolling nothing back).
        proof = prove_ledger(tmp_path / "run")
        assert proof.ok and [e.verdict for e in proof.epochs] == ["exactly once"] * EPOCHS, proof.format()
        assert proof.files == 3 and proof.rolled_back == 0, proof.format()
    finally:
        stop_all(readers, lighthouse, str(tmp_path))
