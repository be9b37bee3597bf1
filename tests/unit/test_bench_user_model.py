"""`towers bench --model`: the user's factory is found and tried before any process starts; errors say the fix."""

from __future__ import annotations

import textwrap

import pytest
import torch

from towers.bench.config import BenchConfig, parse_shape
from towers.bench.user_model import check_user_workload, load_factory
from towers.bench.workloads import make_dataset
from towers.cli import main

MODULE = textwrap.dedent("""
    from torch import nn
    LIMIT = 3
    def build():
        return nn.Linear(6, 2)
    def not_a_model():
        return "model"
    def boom():
        raise RuntimeError("no GPU here")
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_models.py"
    path.write_text(MODULE)
    return path


def test_file_and_module_references_load(user_file, monkeypatch):
    assert isinstance(load_factory(f"{user_file}:build")(), torch.nn.Linear)
    monkeypatch.chdir(user_file.parent)  # `module:factory` is found from the working directory, as python -m does
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert isinstance(load_factory("user_models:build")(), torch.nn.Linear)
    assert load_factory("torch.nn:Linear") is torch.nn.Linear


def test_user_workload_data_and_mse_targets_follow_the_model(user_file):
    config = BenchConfig(model=f"{user_file}:build", input_shape=(6,), loss="mse", steps=2, warmup=1, batch_size=3)
    spec = config.workload_spec()
    assert "Linear, 14 parameters, input (6,), output (2,), loss mse" in check_user_workload(spec)
    data = make_dataset(spec, 2)
    x, y = data.tensors
    assert x.shape == (3 * 3 * 2, 6) and y.shape == (18, 2)  # steps x global batch; targets shaped like outputs
    assert spec.loss_value(spec.make_model()(x), y, reduction="none").shape == (18,)


@pytest.mark.parametrize("argv, message", [
    (["--model", "nocolon"], "must be 'module:factory'"),
    (["--model", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
    (["--model", "{file}:missing"], "has no attribute 'missing'. Public names there: .*'build'"),
    (["--model", "{file}:LIMIT"], "is a int, not a callable"),
    (["--model", "{file}:not_a_model"], "must return a torch.nn.Module. Received: str"),
    (["--model", "{file}:boom"], "raised RuntimeError: no GPU here"),
    (["--model", "{file}:build"], r"fails on a batch of 2 inputs of shape \(1, 28, 28\).*--input-shape"),
    (["--model", "{file}:build", "--input-shape", "6,a"], "--input-shape must be positive integers"),
    (["--dataset", "{file}:build"], "--dataset needs --model"),
])
def test_cli_refuses_a_bad_model_with_exit_code_2(user_file, argv, message, capsys):
    argv = [a.replace("{file}", str(user_file)) for a in argv]
    assert main(["bench", "--replicas", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("towers bench: error:")
    import re
    assert re.search(message, err), err


def test_parse_shape():
    assert parse_shape("3,32,32") == (3, 32, 32) and parse_shape("3x32x32") == (3, 32, 32) and parse_shape("8") == (8,)
    with pytest.raises(ValueError, match="Example: --input-shape 3,32,32"):
        parse_shape("0,3")
