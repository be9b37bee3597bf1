"""Workers killed at random points of a parameter-server job lose no example: the others take their batches.

The real command (``towers launch --strategy ps``, 3 workers + 1 ps task) trains ``Trainer.fit``
with validation data and then evaluates. Non-chief workers SIGKILL themselves at chosen points (two
per fixed job: mid-epoch, an epoch's first batch, a validation batch, the final ``evaluate``) or at
a point drawn from a seeded RNG, which may be a timer at a random instant (it can land inside a push).

The fixed sync job streams its training examples (a torch ``IterableDataset``) instead.

The check counts examples, not accuracy. The model is ``w . x`` on one-hot inputs with the
prediction itself as the loss and plain SGD (lr = global batch size), so each use of example ``i``
in an applied gradient lowers ``w[i]`` by exactly 1: ``-w`` after training is how many times each
example was trained on. Sync mode: exactly once per epoch; async: at least once. The job's ledger
(``towers launch --ledger``: ps task 0 records each share it applied) must count the same uses. The History's
``examples``/``val_examples`` and the final ``evaluate`` count every example too. One job runs
with two ps tasks and a bias (on ps task 1, ``-bias`` counts every use) so both shards are checked.
"""

from __future__ import annotations

import json
import os
import random
import textwrap
from pathlib import Path

import pytest
from cli_support import run, towers_command
from towers.ledger import prove_ledger

pytestmark = pytest.mark.timeout(240)

EXAMPLES, VAL_EXAMPLES, BATCH, EPOCHS = 60, 27, 6, 3

SCRIPT = f"""
    import json, os, signal, sys, threading
    import torch
    from torch import nn
    import towers

    MODE, BIAS = sys.argv[1], sys.argv[2] == "bias"  # bias: a second parameter, on ps task 1 when there are two
    STREAM = sys.argv[4:] == ["stream"]  # the training examples as a stream (an IterableDataset), not tensors
    # one kill per victim: "rank:where:epoch:batch:delay"
    KILLS = {{int(k.split(":")[0]): k.split(":")[1:] for k in sys.argv[3].split(",")}}
    N, NV, B, EPOCHS = {EXAMPLES}, {VAL_EXAMPLES}, {BATCH}, {EPOCHS}

    strategy = towers.strategy_from_env(mode=MODE, timeout_s=60)  # a ps task serves here, then exits 0
    rank = strategy.process_info.rank
    model = nn.Linear(N, 1, bias=BIAS)
    nn.init.zeros_(model.weight)
    if BIAS:
        nn.init.zeros_(model.bias)
    x = torch.eye(N)
    y = torch.zeros(N)

    class Examples(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x, y))

    def prediction_as_loss(y_pred, y_true, reduction="none"):
        return y_pred.reshape(-1)

    class Killer(towers.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0
            self.final = False

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def _maybe(self, phase, batch):
            where, epoch, at, _ = KILLS.get(rank, ("-", -1, -1, 0))
            if where == phase and self.epoch == int(epoch) and batch == int(at):
                print(f"worker rank {{rank}} dies at {{phase}} epoch {{self.epoch}} batch {{batch}}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_begin(self, batch, logs=None):
            self._maybe("train", batch)

        def on_test_batch_begin(self, batch, logs=None):
            self._maybe("final" if self.final else "val", batch)

    if KILLS.get(rank, ("-",))[0] == "timer":
        timer = threading.Timer(float(KILLS[rank][3]), lambda: os.kill(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()

    killer = Killer()
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=float(B)), loss=prediction_as_loss,
                             strategy=strategy)
    history = trainer.fit(Examples() if STREAM else (x, y), epochs=EPOCHS, global_batch_size=B, validation_data=(x[:NV], y[:NV]),
                          callbacks=[killer], shuffle=True)
    killer.final = True
    killer.epoch = int(KILLS.get(rank, ("-", -1))[1])  # a kill in the final evaluate names its batch only
    final = trainer.evaluate((x[:NV], y[:NV]), global_batch_size=B, callbacks=[killer])
    if strategy.is_chief:
        state = trainer.unwrapped_model.state_dict()  # async: pulls first
        uses = (-state["weight"].reshape(-1)).tolist()
        print("RESULT " + json.dumps({{"uses": uses, "examples": history.history["examples"],
                                       "val_examples": history.history["val_examples"],
                                       "final_examples": final["examples"],
                                       "bias_uses": -state["bias"].item() if BIAS else None,
                                       "dead": sorted(strategy.ps_stats()[0]["dead"])}}), flush=True)
    strategy.shutdown()
"""

#: Kills are (victim rank, where, epoch, batch, timer delay s). Each fixed job kills two of the three workers
#: at different points: mid-epoch, an epoch's first batch, validation, the final evaluate.
FIXED = [("sync", ((1, "train", 1, 4, 0.0), (2, "val", 2, 2, 0.0))),
         ("async", ((2, "train", 0, 0, 0.0), (1, "final", 0, 1, 0.0)))]
#: The fixed sync job streams its training examples (a torch IterableDataset): ps task 0 hands out a stream's
#: shares as it does a dataset's (the two-ps-task job below trains on tensors, in sync mode too).
STREAMED = {0}


def _drawn(seed: int) -> tuple[str, tuple[tuple[int, str, int, int, float], ...]]:
    rng = random.Random(seed)
    mode = rng.choice(["sync", "async"])
    where = rng.choice(["train", "val", "final", "timer"])
    epoch = rng.randrange(EPOCHS)
    batch = rng.randrange(EXAMPLES // BATCH if where == "train" else -(-VAL_EXAMPLES // BATCH))
    return mode, ((rng.choice([1, 2]), where, epoch, batch, rng.uniform(0.1, 1.0)),)


#: More drawn kill points: TOWERS_DEAD_WORKER_RUNS=20 python -m pytest tests/distributed/test_ps_dead_worker_data.py
DRAWN = int(os.environ.get("TOWERS_DEAD_WORKER_RUNS", "1"))
CASES = FIXED + [_drawn(seed) for seed in range(11, 11 + DRAWN)]


def _case_id(i: int, case: tuple) -> str:
    return (f"{case[0]}-" + "-".join(f"w{v}{where}e{e}b{b}" for v, where, e, b, _ in case[1])
            + ("-stream" if i in STREAMED else "") + f"-{i}")


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(i, c) for i, c in enumerate(CASES)])
def test_killed_workers_lose_no_example(tmp_path: Path, case):
    mode, kills = CASES[case]
    _check(tmp_path, mode, kills, num_ps=1, stream=case in STREAMED)


def test_with_two_ps_tasks_a_sync_job_trains_every_example_exactly_once_on_both(tmp_path: Path):
    found = _check(tmp_path, "sync", ((2, "train", 1, 3, 0.0),), num_ps=2)
    assert found["bias_uses"] == pytest.approx(EPOCHS * EXAMPLES, abs=1e-3), found  # the shard on ps task 1


def _check(tmp_path: Path, mode: str, kills: tuple[tuple[int, str, int, int, float], ...], *, num_ps: int,
           stream: bool = False) -> dict:
    """Run the job with the ``kills``; assert every example counted; return the chief's result."""
    script = tmp_path / "dead_worker_data.py"
    script.write_text(textwrap.dedent(SCRIPT))
    spec = ",".join(f"{v}:{where}:{e}:{b}:{delay}" for v, where, e, b, delay in kills)
    command = [*towers_command(), "launch", "--strategy", "ps", "--num-ps", str(num_ps), "--nproc-per-node",
               str(3 + num_ps), "--monitor-interval", "0.2", "--ledger", str(tmp_path / "run"), str(script), mode,
               "bias" if num_ps > 1 else "-", spec, *(["stream"] if stream else [])]
    result = run(command, cwd=tmp_path, deadline_s=180, marker=str(script))
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    line = next((ln for ln in out.splitlines() if "RESULT " in ln), None)
    assert line is not None, f"stdout:\n{out}\nstderr:\n{err}"
    found = json.loads(line.split("RESULT ", 1)[1])
    for victim, where, *_ in kills:
        assert where == "timer" or f"worker rank {victim} dies at {where}" in out, f"rank {victim}:\n{out}\n{err}"
    assert found["dead"] == sorted(v for v, *_ in kills), f"the victims did not all die:\n{out}\n{err}"
    uses = [round(u) for u in found["uses"]]
    assert all(abs(u - round(u)) < 1e-3 for u in found["uses"]), found["uses"]
    if mode == "sync":
        assert uses == [EPOCHS] * EXAMPLES, f"examples not trained on exactly {EPOCHS} times: {uses}\n{err}"
    else:
        assert min(uses) >= EPOCHS, f"examples lost in async mode: {uses}\n{err}"
    # The ledger ps task 0 kept of the shares it applied counts each example's uses as the weights do.
    proof = prove_ledger(tmp_path / "run")
    assert [e.epoch for e in proof.epochs] == list(range(EPOCHS)), proof.format()
    assert [round(float(c)) for c in sum(e.counts for e in proof.epochs)] == uses, proof.format()
    assert proof.ok or mode == "async", proof.format()  # sync: exactly once, proved
    assert found["examples"] == [float(EXAMPLES)] * EPOCHS, found
    assert found["val_examples"] == [float(VAL_EXAMPLES)] * EPOCHS, found
    assert found["final_examples"] == VAL_EXAMPLES, found
    return found
