"""`towers launch --strategy ps` runs DiLoCo as a user would: the README's train.py unchanged under
``--strategy-option mode=diloco``, and examples/diloco.py as its docstring runs it (shortened to 2 epochs);
a worker killed in the middle of a window loses no example (the job's ledger proves each trained once).

The real command in a new session with a deadline, no process left behind (``cli_support.run``).
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from cli_support import run, towers_command
from doc_blocks import ROOT, python_blocks
from towers.ledger import prove_ledger

pytestmark = pytest.mark.timeout(240)

DEADLINE_S = 120.0
LAUNCH = ["launch", "--strategy", "ps", "--num-ps", "1", "--nproc-per-node", "3"]


def test_readme_script_runs_unchanged_under_diloco(tmp_path):
    readme = [b for b in python_blocks(ROOT / "README.md") if b.mark == "same-on-2-replicas"][0]
    script = tmp_path / "train.py"
    script.write_text(readme.code)
    result = run([*towers_command(), *LAUNCH, "--strategy-option", "mode=diloco", "--strategy-option", "sync_every=4",
                  str(script)], cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(v) for v in re.findall(r"epoch \d+: last step's loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], result.stdout
    # the chief's end-of-job line: DiLoCo's steps and bytes per example (3 epochs of 1438 examples, 2 workers)
    match = re.search(r"diloco: (\d+) inner step\(s\), (\d+) outer step\(s\) \(sync_every 4, float32\), (\d+) "
                      r"example\(s\); ([0-9.]+) bytes sent per example", result.stdout + result.stderr)
    assert match is not None, result.stdout + result.stderr
    inner, outer, examples = (int(match.group(i)) for i in (1, 2, 3))
    assert (inner, outer, examples) == (3 * 23, 3 * 6, 3 * 719)  # 23 steps per epoch: windows 4,4,4,4,4,3


def test_diloco_example_trains_and_reports_its_bytes(tmp_path):
    example = ROOT / "examples" / "diloco.py"
    result = run([*towers_command(), *LAUNCH, str(example), "--epochs", "2", "--compression", "int8"],
                 cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(example))
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"diloco H=8 int8 fragments=1: val accuracy ([0-9.]+), final loss [0-9.]+, (\d+) bytes sent "
                      r"per example", result.stdout)
    assert match is not None, result.stdout + result.stderr
    accuracy, per_example = float(match.group(1)), int(match.group(2))
    assert accuracy > 0.8
    # the seed CNN's 1.39 MB of float32 parameters, as int8 once per 8 steps of 32 examples: ~1.4 kB per example
    assert 500 < per_example < 3000


KILL_SCRIPT = """
    import json, os, signal
    import torch
    from torch import nn
    import towers

    N, B, EPOCHS = 60, 6, 3  # 3 workers: shares of 2 examples, 10 steps per epoch, windows of 4, 4 and 2 steps
    strategy = towers.strategy_from_env(mode="diloco", sync_every=4, timeout_s=60)  # a ps task serves, then exits
    rank = strategy.process_info.rank
    torch.manual_seed(0)
    model = nn.Linear(N, 2)
    x, y = torch.eye(N), torch.arange(N) % 2

    class Killer(towers.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if rank == 2 and self.trainer.progress.epoch == 1 and batch == 2:  # 2 inner steps into a window
                print("worker rank 2 dies mid-window", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                             loss=torch.nn.functional.cross_entropy, strategy=strategy)
    history = trainer.fit((x, y), epochs=EPOCHS, global_batch_size=B, callbacks=[Killer()])
    if strategy.is_chief:
        print("RESULT " + json.dumps({"examples": history.history["examples"], "loss": history.history["loss"],
                                       "dead": sorted(strategy.ps_stats()[0]["dead"])}), flush=True)
    strategy.shutdown()
"""


def test_a_worker_killed_mid_window_loses_no_example(tmp_path):
    script = tmp_path / "diloco_kill.py"
    script.write_text(textwrap.dedent(KILL_SCRIPT))
    result = run([*towers_command(), "launch", "--strategy", "ps", "--num-ps", "1", "--nproc-per-node", "4",
                  "--monitor-interval", "0.2", "--ledger", str(tmp_path / "run"), str(script)],
                 cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    out, err = result.stdout, result.stderr
    assert result.returncode == 0 and "worker rank 2 dies mid-window" in out, f"stdout:\n{out}\nstderr:\n{err}"
    found = json.loads(next(line for line in out.splitlines() if "RESULT " in line).split("RESULT ", 1)[1])
    assert found["dead"] == [2] and found["examples"] == [60.0] * 3, found
    # The victim's window was never pushed: ps task 0 handed its batches to the others, and its ledger of the
    # shares it applied proves every example trained exactly once per epoch.
    proof = prove_ledger(tmp_path / "run")
    assert proof.ok and [e.epoch for e in proof.epochs] == [0, 1, 2], proof.format()
    assert [round(float(c)) for c in sum(e.counts for e in proof.epochs)] == [3] * 60, proof.format()
