"""WandbLogger and MLflowLogger with the real packages, no network: wandb offline, MLflow on a local folder.

One small fit runs both loggers (one wandb run for the whole file); what they wrote is read back from
wandb's offline run file and through ``MlflowClient`` and compared with the History the fit returned.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.callbacks import Callback, MLflowLogger, WandbLogger

# Imported inside the tests only: mlflow decides at its import whether to send usage telemetry.
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("wandb", "mlflow")),
                                reason="needs wandb and mlflow: pip install 'towers[wandb,mlflow]'")

EPOCHS, BATCH, N, EVERY = 2, 8, 40, 2   # 5 steps an epoch; step logs at batches 0, 2, 4 of each epoch
STEP_LOGS = [1, 3, 5, 6, 8, 10]          # their global_step
REPORTS = [4, 6]                         # a step breakdown's reports (time/<phase>): off the period and on it
PARAMS = {"epochs": "2", "steps": "5", "global_batch_size": "8", "num_replicas": "1", "strategy": "one_device"}


class ExtraKeys(Callback):
    """Puts into the logs what the Trainer adds when it measures them (throughput, the step breakdown), plus
    values a tracker cannot take, so that the loggers are checked on every kind of key."""

    @staticmethod
    def values(step: float) -> dict[str, float]:
        return {"examples_per_second": 100.0 + step, "tokens_per_second": 2000.0 + step, "mfu": 0.25,
                "time/forward": 0.01 * step, "time/comm_wait": 0.5}

    def on_train_batch_end(self, batch, logs=None):
        values = self.values(logs["global_step"])
        if logs["global_step"] not in REPORTS:  # the breakdown's keys are in the logs of its report steps only
            values = {k: v for k, v in values.items() if not k.startswith("time/")}
        logs.update(values, note="not a number", flag=True)

    def on_epoch_end(self, epoch, logs=None):
        logs.update(self.values(epoch), note="not a number", flag=True)


def _trainer() -> towers.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                          metrics=["accuracy"], strategy=towers.OneDeviceStrategy("cpu"))


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _wandb_processes() -> list[int]:
    """This process's children that run wandb's service."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"wandb" in cmd:
            found.append(int(stat.parent.name))
    return found


def _wandb_records(path: Path):
    """The records of an offline run's ``.wandb`` file: LevelDB's log format (32 KiB blocks of
    ``crc32 | length u16 | type u8`` chunks after a 7-byte ``:W&B`` header), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, i, chunks = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        left = 32768 - i % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            i += left
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + 7])
        chunks, i = chunks + data[i + 7:i + 7 + length], i + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no network
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(name, str(tmp / name.lower()))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the client alone (mlflow-skinny) has no database store
        import mlflow
        import wandb

        x, y = _data()
        wandb_logger = WandbLogger(project="towers-test", dir=tmp / "wandb", mode="offline", config={"model": "mlp"},
                                   log_every_n_steps=EVERY,
                                   settings=wandb.Settings(console="off", disable_git=True, x_disable_stats=True))
        mlflow_logger = MLflowLogger("towers-test", tracking_uri=f"file:{tmp / 'mlruns'}", run_name="fit",
                                     log_every_n_steps=EVERY)
        history = _trainer().fit((x, y), EPOCHS, BATCH, validation_data=(x, y),
                                 callbacks=[ExtraKeys(), wandb_logger, mlflow_logger])
        client = mlflow.tracking.MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
        services = _wandb_processes()
        wandb.teardown()
        yield {"history": history.history, "wandb_dir": tmp / "wandb", "client": client, "run_id": mlflow_logger.run_id,
               "services": services, "left": _wandb_processes(), "mlruns": tmp / "mlruns"}


def test_mlflow_logs_the_history_fit_parameters_and_step_logs(fitted):
    client, run_id, history = fitted["client"], fitted["run_id"], fitted["history"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "fit"
    assert run.data.params == PARAMS
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples"):
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert logged == list(enumerate(history[key])), key
    for key in ExtraKeys.values(0):  # throughput and the step breakdown, under their own names
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert logged == [(e, ExtraKeys.values(e)[key]) for e in range(EPOCHS)], key
    assert {"note", "flag"}.isdisjoint(run.data.metrics)
    batch_loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "batch/loss"))
    assert [s for s, _ in batch_loss] == STEP_LOGS
    assert batch_loss[-1][1] == pytest.approx(history["loss"][-1])  # the last step's running mean is the epoch's
    throughput = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "batch/examples_per_second"))
    assert throughput == [(s, 100.0 + s) for s in STEP_LOGS]
    # Every report reaches the tracker at its own step, between the periodic step logs too (alone there).
    assert sorted(m.step for m in client.get_metric_history(run_id, "batch/time/forward")) == REPORTS


def test_wandb_offline_run_holds_the_history_config_and_step_logs(fitted):
    history = fitted["history"]
    [path] = list(fitted["wandb_dir"].glob("wandb/offline-run-*/run-*.wandb"))
    rows, config = [], {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    assert {k: config[k] for k in (*PARAMS, "model")} == {
        "epochs": 2, "steps": 5, "global_batch_size": 8, "num_replicas": 1, "strategy": "one_device", "model": "mlp"}
    epochs = [r for r in rows if "epoch" in r]
    assert [r["epoch"] for r in epochs] == list(range(EPOCHS))
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples"):
        assert [r[key] for r in epochs] == history[key], key
    for key in ExtraKeys.values(0):
        assert [r[key] for r in epochs] == [ExtraKeys.values(e)[key] for e in range(EPOCHS)], key
    assert all("note" not in r and "flag" not in r for r in rows)
    steps = [r for r in rows if "batch/loss" in r]
    assert [r["global_step"] for r in steps] == STEP_LOGS
    assert [r["batch/examples_per_second"] for r in steps] == [100.0 + s for s in STEP_LOGS]
    assert steps[-1]["batch/loss"] == pytest.approx(history["loss"][-1])
    reports = [r for r in rows if "batch/time/forward" in r]
    assert [r["global_step"] for r in reports] == REPORTS and {k for k in reports[0] if not k.startswith("_")} == {
        "global_step", "batch/time/forward", "batch/time/comm_wait"}  # off the period: the report alone


def test_wandb_service_was_running_and_is_gone(fitted):
    assert fitted["services"], "expected wandb's service process while the run was open"
    assert fitted["left"] == []


@pytest.mark.parametrize("how", ["run_id", "mlflow.start_run"])
def test_mlflow_logs_into_the_users_run_and_leaves_it_open(fitted, monkeypatch, how):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{fitted['mlruns']}")  # what mlflow.start_run() uses
    client, (x, y) = fitted["client"], _data()
    with contextlib.ExitStack() as stack:
        if how == "run_id":
            run_id = client.create_run(client.get_experiment_by_name("towers-test").experiment_id).info.run_id
            logger = MLflowLogger(tracking_uri=f"file:{fitted['mlruns']}", run_id=run_id, log_every_n_steps=None)
        else:
            run_id = stack.enter_context(mlflow.start_run()).info.run_id
            logger = MLflowLogger(log_every_n_steps=None)
        history = _trainer().fit((x, y), 1, BATCH, callbacks=[logger])
        run = client.get_run(run_id)
        assert run.info.status == "RUNNING"  # the user's run: they end it
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == history.history["loss"]
    assert run.data.params == {**PARAMS, "epochs": "1"}
    assert not any(key.startswith("batch/") for key in run.data.metrics)  # None: epochs only


class _FakeStrategy:
    is_chief = False
    name = "mirrored"


class _FakeTrainer:
    strategy = _FakeStrategy()


def test_a_non_chief_replica_logs_nothing_and_never_imports_the_package(tmp_path, monkeypatch):
    loggers = [WandbLogger(dir=tmp_path / "wandb", mode="offline", log_every_n_steps=1),
               MLflowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}", log_every_n_steps=1)]
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import from here on raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    for logger in loggers:
        logger.set_trainer(_FakeTrainer())
        logger.set_params({"epochs": 1})
        logger.on_train_begin({})
        logger.on_train_batch_end(0, {"loss": 1.0, "global_step": 1})
        logger.on_epoch_end(0, {"loss": 1.0})
        logger.on_train_end({"loss": 1.0})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cls, extra", [(WandbLogger, "wandb"), (MLflowLogger, "mlflow")])
def test_a_missing_package_or_a_bad_period_says_what_to_do(cls, extra, monkeypatch):
    with pytest.raises(ValueError, match="log_every_n_steps must be a positive integer, or None"):
        cls(log_every_n_steps=0)
    monkeypatch.setitem(sys.modules, cls.package, None)
    with pytest.raises(ImportError, match=rf"{cls.__name__} needs the {cls.package} package.*pip install 'towers\[{extra}\]'"):
        cls()


@pytest.mark.parametrize("store", ["file", "default"])
def test_a_tracking_store_mlflow_refuses_is_one_line_naming_the_fix(store, tmp_path, monkeypatch):
    """MLflow 3 refuses a file: store unless MLFLOW_ALLOW_FILE_STORE=true, and its default (sqlite:///mlflow.db)
    needs the full mlflow, which the client alone (mlflow-skinny, what towers[mlflow] installs) is not."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    if store == "default" and importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow is installed: its default store opens")
    uri = f"file:{tmp_path / 'mlruns'}" if store == "file" else None
    x, y = _data()
    with pytest.raises(towers.TowersError) as caught:
        _trainer().fit((x, y), 1, BATCH, callbacks=[MLflowLogger(tracking_uri=uri)])
    message = str(caught.value)
    assert "\n" not in message and message.startswith("MLflowLogger cannot open its tracking store")
    assert f"tracking_uri={uri!r}" in message and "http://host:5000" in message
    assert ("MLFLOW_ALLOW_FILE_STORE=true" if store == "file" else "pip install mlflow") in message
