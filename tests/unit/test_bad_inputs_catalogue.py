"""Bad input, listed: each case ends with one line that says what was wrong, the value received, and the fix.

CLI cases run ``towers.cli.main`` in this process (nothing starts: each fails before any process or
socket); library cases call the public API. Each case names a phrase the message must hold and the
value it must repeat.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers import cli, cluster
from towers.checkpoint import CheckpointManager, load_checkpoint


def _cli(*argv: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:
            code = exc.code
    assert code not in (0, None), f"towers {' '.join(argv)} was accepted"
    return err.getvalue().strip()


def _trainer(in_features: int = 2) -> towers.Trainer:
    model = nn.Linear(in_features, 2)
    return towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)


_XY = (torch.ones(4, 2), torch.zeros(4, dtype=torch.long))
_ONE = towers.OneDeviceStrategy("cpu")
_DS = torch.utils.data.TensorDataset(torch.ones(4, 2))

# (name, call, phrase the message must contain, the value it must repeat)
CASES: list[tuple[str, Callable[[], Any], str, str]] = [
    ("k8s slurm time", lambda: _cli("k8s", "--name", "j", "--kind", "slurm", "--time", "forever", "t.py"),
     "--time must be a SLURM time limit", "forever"),
    ("k8s name", lambda: _cli("k8s", "--name", "My_Job", "t.py"), "DNS-1123", "My_Job"),
    ("k8s nnodes", lambda: _cli("k8s", "--name", "j", "--nnodes", "0", "t.py"), "--nnodes must be", "0"),
    ("k8s port", lambda: _cli("k8s", "--name", "j", "--port", "80", "t.py"), "--port must be in", "80"),
    ("k8s cpus", lambda: _cli("k8s", "--name", "j", "--cpus-per-node", "lots", "t.py"), "quantity", "lots"),
    ("k8s memory", lambda: _cli("k8s", "--name", "j", "--memory-per-node", "64GB", "t.py"), "quantity", "64GB"),
    ("k8s checkpoint size", lambda: _cli("k8s", "--name", "j", "--checkpoint-size", "big", "t.py"), "quantity", "big"),
    ("k8s partition", lambda: _cli("k8s", "--name", "j", "--kind", "slurm", "--partition", "gpu queue", "t.py"),
     "--partition must be", "gpu queue"),
    ("k8s nproc", lambda: _cli("k8s", "--name", "j", "--nproc-per-node", "0", "t.py"), "nproc", "0"),
    ("k8s image", lambda: _cli("k8s", "--name", "j", "--image", "a b", "t.py"), "--image", "a b"),
    ("k8s namespace", lambda: _cli("k8s", "--name", "j", "--namespace", "Prod", "t.py"), "--namespace", "Prod"),
    ("k8s gpus", lambda: _cli("k8s", "--name", "j", "--gpus-per-node", "-1", "t.py"), "--gpus-per-node", "-1"),
    ("k8s checkpoint dir", lambda: _cli("k8s", "--name", "j", "--checkpoint-dir", "ckpt", "t.py"),
     "absolute path", "ckpt"),
    ("k8s env name", lambda: _cli("k8s", "--name", "j", "--env", "1X=2", "t.py"), "--env", "1X"),
    ("k8s max restarts", lambda: _cli("k8s", "--name", "j", "--max-restarts", "-2", "t.py"), "--max-restarts", "-2"),
    ("launch script", lambda: _cli("launch", "--nproc-per-node", "2", "nope.py"), "script not found", "nope.py"),
    ("launch nproc", lambda: _cli("launch", "--nproc-per-node", "zero", "t.py"), "--nproc-per-node", "zero"),
    ("launch port", lambda: _cli("launch", "--master-port", "70000", "t.py"), "--master-port", "70000"),
    ("launch strategy", lambda: _cli("launch", "--strategy", "mirorred", "t.py"), "--strategy must be", "mirorred"),
    ("launch num ps", lambda: _cli("launch", "--strategy", "ps", "--num-ps", "0", "t.py"), "parameter server", "0"),
    ("launch nnodes", lambda: _cli("launch", "--nnodes", "2:1", "t.py"), "--nnodes", "2:1"),
    ("launch module", lambda: _cli("launch", "-m", "a/b.py"), "dotted module name", "a/b.py"),
    ("device index", lambda: towers.device("/gpu:x"), "Invalid device name", "/gpu:x"),
    ("device kind", lambda: towers.device("tpu:0"), "unknown device kind", "tpu:0"),
    ("precision", lambda: towers.MirroredStrategy(precision="fp8"), "precision must be", "fp8"),
    ("ps mode", lambda: towers.ParameterServerStrategy(num_ps=1, mode="fast"), "mode must be", "fast"),
    ("accumulation", lambda: towers.MirroredStrategy(gradient_accumulation_steps=0), "gradient_accumulation", "0"),
    ("reduce op", lambda: _ONE.reduce("median", torch.ones(2)), "reduce op must be", "median"),
    ("reduce value", lambda: _ONE.reduce("sum", "abc"), "expects a tensor", "str"),
    ("global batch 0", lambda: _ONE.distribute_dataset(_DS, 0), "global_batch_size", "0"),
    ("global batch < 0", lambda: _ONE.distribute_dataset(_DS, -3), "global_batch_size", "-3"),
    ("TF_CONFIG json", lambda: cluster.from_env(environ={"TF_CONFIG": "{bad json"}), "not valid JSON", "{bad json"),
    ("TF_CONFIG index", lambda: cluster.from_env(environ={"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, '
                                                           '"task": {"type": "worker", "index": 5}}'}),
     "out of range", "5"),
    ("RANK", lambda: cluster.from_env(environ={"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                                                "MASTER_PORT": "1"}), "RANK must be", "x"),
    ("RANK >= WORLD_SIZE", lambda: cluster.from_env(environ={"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "a",
                                                              "MASTER_PORT": "1"}), "RANK must be < WORLD_SIZE", "3"),
    ("join timeout", lambda: cluster.from_env(environ={"TOWERS_JOIN_TIMEOUT_S": "soon"}), "TOWERS_JOIN_TIMEOUT_S",
     "soon"),
    ("metric name", lambda: towers.Trainer(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                                           loss=F.cross_entropy, metrics=["acuracy"]), "Unknown metric", "acuracy"),
    ("x and y lengths", lambda: _trainer().fit((torch.ones(4, 2), torch.zeros(3, dtype=torch.long)), epochs=1,
                                               global_batch_size=2), "same length", "3"),
    ("input width", lambda: _trainer(3).fit(_XY, epochs=1, global_batch_size=2), "cannot take this batch", "(2, 2)"),
    ("evaluate batch", lambda: _trainer().evaluate(_XY, global_batch_size=0), "global_batch_size", "0"),
    ("zero epochs", lambda: _trainer().fit(_XY, epochs=0, global_batch_size=2), "epochs must be", "epochs=0"),
    ("epochs not past initial_epoch", lambda: _trainer().fit(_XY, epochs=2, global_batch_size=2, initial_epoch=2),
     "nothing would train", "initial_epoch=2"),
    ("negative clip norm", lambda: towers.OneDeviceStrategy("cpu").clip_grad_norm_(nn.Linear(2, 2).parameters(), -1),
     "max_norm must be", "-1"),
    ("checkpoint path", lambda: load_checkpoint("/nonexistent/towers/ckpt.pt"), "No checkpoint at",
     "/nonexistent/towers/ckpt.pt"),
    ("max_to_keep", lambda: CheckpointManager("/nonexistent/towers", max_to_keep=0), "max_to_keep", "0"),
    ("checkpoint prefix", lambda: CheckpointManager("/nonexistent/towers", prefix="a b"), "prefix must be", "a b"),
    ("spawn nprocs", lambda: towers.spawn(print, 0), "nprocs must be", "0"),
    ("spawn timeout", lambda: towers.spawn(print, 1, timeout_s=0), "timeout_s must be", "0"),
    # Boolean options are parsed strictly, by one parser: `perhaps` is no True, from the command line or in code.
    ("flag option", lambda: _cli("launch", "--nproc-per-node", "2", "--strategy", "sharded", "--strategy-option",
                                  "cpu_offload=perhaps", "t.py"), "cpu_offload must be True or False", "perhaps"),
    ("flag argument", lambda: towers.MirroredStrategy(find_unused_parameters="maybe"),
     "find_unused_parameters must be True or False", "maybe"),
    ("flag of a loader", lambda: _ONE.distribute_dataset(_DS, 2, persistent_workers="no"),
     "persistent_workers must be True or False", "no"),
    ("bucket option", lambda: _cli("launch", "--nproc-per-node", "2", "--strategy", "mirrored", "--strategy-option",
                                    "bucket_cap_mb=abc", "t.py"), "takes bucket_cap_mb as a number", "abc"),
    ("bucket argument", lambda: towers.MirroredStrategy(bucket_cap_mb="abc"), "bucket_cap_mb must be a number", "abc"),
    ("mesh of other size", lambda: _cli("launch", "--nproc-per-node", "4", "--strategy", "sharded", "--mesh", "tp=3",
                                         "t.py"), "Use --mesh tp=2 or --mesh tp=4 on 4 processes", "tp=3"),
    ("mesh under ps", lambda: _cli("launch", "--nproc-per-node", "2", "--strategy", "ps", "--mesh", "tp=2", "t.py"),
     "'ps' takes no mesh", "--mesh tp=2"),
    ("ledger missing", lambda: _cli("verify", "--ledger", "/nonexistent/towers/run"), "needs the run's directory",
     "/nonexistent/towers/run"),
    ("ledger a file", lambda: _cli("launch", "--nproc-per-node", "2", "--ledger", "t.py", "t.py"),
     "--ledger must be a directory", "t.py"),
    ("verify strategy", lambda: _cli("verify", "--strategies", "bogus", "t.py"), "Unknown strategy", "bogus"),
    ("verify timeout", lambda: _cli("verify", "--timeout", "0", "t.py"), "--timeout must be", "0"),
    ("plan seq len", lambda: _cli("plan", "--model", "towers.models_gpt:GPT", "--seq-len", "-1"),
     "--seq-len) must be a positive number", "-1"),
]


def test_the_catalogue_has_at_least_forty_cases():
    assert len(CASES) >= 40
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize("name, call, phrase, value", CASES, ids=[c[0] for c in CASES])
def test_each_bad_input_gets_one_line_with_what_the_value_and_the_fix(name, call, phrase, value, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("t.py").write_text("print('never runs')\n")
    try:
        outcome = call()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        message = str(exc)
    else:
        assert isinstance(outcome, str), f"{name}: accepted, returned {outcome!r}"
        message = outcome
    assert "\n" not in message.strip(), f"{name}: more than one line:\n{message}"
    assert "Traceback" not in message
    assert phrase in message, f"{name}: {message}"
    assert value in message, f"{name}: the value {value!r} is not repeated: {message}"
