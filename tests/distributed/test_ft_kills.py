"""A fault-tolerant ``Trainer.fit`` job killed ten times at seeded moments, proved exactly once by its ledger.

One ``towers launch --strategy ft --ledger`` job of two replica groups runs ``tests/ft_kills_job.py``
(an unchanged ``Trainer.fit`` script plus a kill plan): kill after kill, a group SIGKILLs itself at
a moment drawn from the seed (between steps, in the forward pass, in the backward pass before the
gradients are summed, after the step's commit before its ledger line, after its ledger line), the
launcher restarts it alone, it heals and trains with the other group, and the next kill comes.
Each moment comes twice; six of the ten kills are mid-step (forward, backward, after the commit).
The last kill comes in the job's last step, so that group is started again after the survivor
ended (or, when the survivor ended first, not at all): one line must say that it found the job
complete, and the launcher exit 0 within seconds of the survivor's end.

Then ``towers verify --ledger`` (``prove_ledger``) must prove every example of every epoch trained
exactly once, counting from a live group's record each share whose group died between the commit and
its own line; the survivor's History must count every example of each epoch, and its parameters be
those of one device running the same steps (the dead groups' shares were trained, not only recorded).
``TOWERS_TEST_SEED`` replays a draw.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest
import torch

from cli_support import OutputReader, clean_env, kill, processes_running, start, towers_command
from ft_kills_job import STEPS_PER_EPOCH
from towers.ledger import prove_ledger

pytestmark = pytest.mark.timeout(240)

JOB = Path(__file__).resolve().parents[1] / "ft_kills_job.py"
KILLS = 10
#: The job's epochs (16 steps each): the kills before the last one took 27-76 steps in the runs here.
EPOCHS = 8
#: The most seconds from the survivor's end to the launcher's exit (measured here: about 4 s).
END_BOUND_S = 15.0
#: The job's deadline: a hang, not a slow machine (the job takes about 30 s on 2 idle cores).
JOB_DEADLINE_S = 200


def kill_plan(rng: random.Random) -> list[dict]:
    """``KILLS`` kills: each of the 5 moments twice, in a seeded order, of a seeded group, ``after`` 1-3 steps."""
    from ft_kills_job import PHASES

    phases = [*PHASES, *PHASES]
    rng.shuffle(phases)
    plan: list[dict] = [{"group": rng.randrange(2), "phase": p, "after": rng.randint(1, 3)} for p in phases]
    plan[-1]["after"] = "end"  # in the job's last step: the group is started again after the survivor ended
    return plan


def _one_device_reference(epochs: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    import towers
    from ft_kills_job import GLOBAL_BATCH_SIZE, dataset, model_and_optimizer

    net, optimizer = model_and_optimizer(0)  # group 0's first weights: the job's (group 1 heals to them)
    trainer = towers.Trainer(net, optimizer, loss=torch.nn.functional.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"))
    history = trainer.fit(dataset(), epochs=epochs, global_batch_size=GLOBAL_BATCH_SIZE)
    return net.state_dict(), history["examples"]


def test_ten_seeded_kills_lose_nothing_and_the_job_ends_when_training_ends(tmp_path: Path) -> None:
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    seed = int(os.environ.get("TOWERS_TEST_SEED", time.time_ns() % 10**6))
    plan = kill_plan(random.Random(seed))
    draw = f"(TOWERS_TEST_SEED={seed}: {[(k['group'], k['phase'], k['after']) for k in plan]})"
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    restarts = {g: sum(k["group"] == g for k in plan) for g in (0, 1)}
    argv = [*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "ft", "--strategy-option",
            "peer_timeout_s=1", "--group-restarts", str(max(restarts.values())), "--ledger", str(tmp_path / "run"),
            str(JOB), str(tmp_path), str(plan_file), "--epochs", str(EPOCHS)]
    env = clean_env({"PYTHONPATH": str(JOB.parent)})
    env.pop("RUST_LOG", None)
    launcher = OutputReader(start(argv, cwd=tmp_path, env=env))
    try:
        try:
            out, err = launcher.collect(timeout_s=JOB_DEADLINE_S)
        except Exception:
            (tmp_path / "launcher.out").write_text("\n".join(launcher.so_far()))  # what it said before the deadline
            raise
        ended = time.time()
        (tmp_path / "launcher.out").write_text(out)  # the whole output, for a failure's post-mortem
        (tmp_path / "launcher.err").write_text(err)
    finally:
        if launcher.proc.poll() is None:
            kill([launcher.proc.pid])
        leftovers = processes_running(str(tmp_path))
        kill(leftovers)
    assert not leftovers, f"processes left behind: {leftovers} {draw}"
    assert launcher.proc.returncode == 0, f"launcher exited {launcher.proc.returncode} {draw}\n{out[-3000:]}\n{err[-4000:]}"

    made = re.findall(r"killing group (\d) at (\w+) of step \d+ \(kill (\d+)\)", out)
    assert [(int(g), p) for g, p, _ in made] == [(k["group"], k["phase"]) for k in plan], \
        f"kills made {made} (fewer: the job's {EPOCHS} epochs ended first) {draw}\n{out[-3000:]}"
    for group, count in restarts.items():
        # The group killed in the last step is not started again if the survivor ended before its supervisor saw it.
        counts = (count, count - 1) if group == plan[-1]["group"] else (count,)
        said = [f"replica group {group} was restarted alone {n} time(s)" in err for n in counts if n]
        assert any(said) or counts[-1] == 0, f"{draw}\n{err[-3000:]}"
    # The group killed in the last step was started again after the survivor ended: it said so, once, and exited 0.
    complete = [line for line in err.splitlines() if "found the job complete" in line]
    assert len(complete) == 1 and f"replica group {plan[-1]['group']} found the job complete" in complete[0], \
        f"{complete} {draw}\n{err[-3000:]}"
    (done,) = [line for line in out.splitlines() if ": done " in line]
    survivor_end = float(done.split(": done ", 1)[1].split()[0])
    assert ended - survivor_end < END_BOUND_S, f"the job ended {ended - survivor_end:.1f} s after the survivor {draw}"

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["group"] == 1 - plan[-1]["group"] and summary["job_step"] == EPOCHS * STEPS_PER_EPOCH, summary
    proof = prove_ledger(tmp_path / "run")
    assert proof.ok and [e.verdict for e in proof.epochs] == ["exactly once"] * EPOCHS, f"{draw}\n{proof.format()}"
    # Each kill after a commit and before the ledger line leaves its share to the live group's record.
    assert proof.witnessed == sum(k["phase"] == "commit" for k in plan), f"{draw}\n{proof.format()}"

    reference, examples = _one_device_reference(EPOCHS)
    assert summary["examples"] == examples[-len(summary["epochs"]):], summary
    final = torch.load(tmp_path / "final.pt")
    for key in final:  # every committed step took its whole global batch: the same maths as one device
        torch.testing.assert_close(final[key], reference[key], rtol=1e-4, atol=1e-5, msg=f"{key} {draw}")
