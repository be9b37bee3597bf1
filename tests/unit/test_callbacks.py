"""Callbacks on one device: hooks and logs, files, stopping, schedules, backups that resume at the exact step."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers import checkpoint as ckpt
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.training import Trainer
from towers.training import callbacks as C


def _data(n: int = 40):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _trainer(*, dropout: bool = False, lr: float = 0.1) -> Trainer:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.ReLU(), *([nn.Dropout(0.3)] if dropout else []), nn.Linear(8, 2)]
    model = nn.Sequential(*layers)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), F.cross_entropy,
                   metrics=["accuracy"], strategy=towers.OneDeviceStrategy("cpu"))


@contextlib.contextmanager
def _towers_log(caplog, level=logging.INFO):
    # The towers logger does not propagate to the root logger: attach pytest's handler to it.
    logger = logging.getLogger("towers")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(level, logger="towers"):
            yield
    finally:
        logger.removeHandler(caplog.handler)


class Recorder(C.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *args: self.calls.append((name, *args))
        return super().__getattribute__(name)


def test_hooks_order_and_documented_logs():
    x, y = _data()
    rec = Recorder()
    trainer = _trainer()
    trainer.fit((x, y), 1, 16, validation_data=(x, y), callbacks=[rec])
    names = [c[0] for c in rec.calls]
    assert names[:3] == ["on_train_begin", "on_epoch_begin", "on_train_batch_begin"]
    assert names.count("on_train_batch_end") == 3 and names[-2:] == ["on_epoch_end", "on_train_end"]
    assert names.index("on_test_begin") > names.index("on_train_batch_end")
    batch_logs = [c[2] for c in rec.calls if c[0] == "on_train_batch_end"]
    assert [b["size"] for b in batch_logs] == [16, 16, 8] and [b["examples"] for b in batch_logs] == [16, 32, 40]
    assert set(batch_logs[0]) == {"loss", "accuracy", "size", "examples", "nonfinite_replicas", "global_step"}
    epoch_logs = next(c[2] for c in rec.calls if c[0] == "on_epoch_end")
    assert set(epoch_logs) == {"loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples", "val_examples",
                               "examples_per_second", "mfu"}  # no tokens: not a token model
    assert epoch_logs["loss"] == batch_logs[-1]["loss"]  # the epoch value is the running mean at its end
    assert epoch_logs["examples"] == 40 and epoch_logs["val_examples"] == 40  # every example, counted
    rec.calls.clear()
    trainer.predict(x, batch_size=32, callbacks=[rec])
    assert [c[0] for c in rec.calls] == ["on_predict_begin", "on_predict_batch_begin", "on_predict_batch_end",
                                         "on_predict_batch_begin", "on_predict_batch_end", "on_predict_end"]
    with pytest.raises(TypeError, match="Callback instances"):
        trainer.fit((x, y), 1, 16, callbacks=[object()])


def test_csv_logger_and_model_checkpoint(tmp_path):
    x, y = _data()
    trainer = _trainer()
    best = C.ModelCheckpoint(tmp_path / "best.pt", monitor="val_accuracy", save_best_only=True, save_weights_only=True)
    every = C.ModelCheckpoint(str(tmp_path / "m-{epoch:02d}-{val_loss:.3f}.pt"))
    trainer.fit((x, y), 3, 16, validation_data=(x, y),
                callbacks=[C.CSVLogger(tmp_path / "log.csv"), best, every])
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"] and float(rows[2]["loss"]) == trainer.history["loss"][2]
    assert sorted(p.name for p in tmp_path.glob("m-*.pt"))[0].startswith("m-01-")
    assert best.mode == "max" and best.best == max(trainer.history["val_accuracy"])
    assert set(ckpt.load_checkpoint(tmp_path / "best.pt")) == {"model"}  # weights only
    full = ckpt.load_checkpoint(every.last_path)
    assert full["epoch"] == 3 and full["step"] == 0 and full["history"]["epoch"] == [0, 1, 2]
    C.CSVLogger(tmp_path / "log.csv", append=True)  # appending keeps the header
    trainer.fit((x, y), 1, 16, validation_data=(x, y), callbacks=[C.CSVLogger(tmp_path / "log.csv", append=True)])
    assert len(list(csv.reader(open(tmp_path / "log.csv")))) == 5
    with pytest.raises(ValueError, match="names a field the logs lack"):
        trainer.fit((x, y), 1, 16, callbacks=[C.ModelCheckpoint(str(tmp_path / "{val_loss}.pt"))])


def test_early_stopping_and_lr_schedule_restore_best_weights():
    x, y = _data()
    trainer = _trainer(lr=0.01)
    weights = []

    class Snapshot(C.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights.append({k: v.clone() for k, v in self.model.state_dict().items()})

    # lr grows every epoch, so "lr" (mode min) never improves after epoch 0: stop after `patience` epochs.
    stop = C.EarlyStopping("lr", patience=2, restore_best_weights=True)
    history = trainer.fit((x, y), 10, 16, callbacks=[
        C.LearningRateScheduler(lambda epoch, lr: 0.01 * (epoch + 1)), Snapshot(), stop])
    assert history["lr"] == pytest.approx([0.01, 0.02, 0.03])
    assert stop.stopped_epoch == 2 and stop.best_epoch == 0
    assert all(torch.equal(v, weights[0][k]) for k, v in trainer.unwrapped_model.state_dict().items())
    with pytest.raises(ValueError, match="finite float"):
        trainer.fit((x, y), 1, 16, callbacks=[C.LearningRateScheduler(lambda e, lr: float("nan"))])
    with pytest.raises(ValueError, match="patience"):
        C.EarlyStopping(patience=-1)


def test_terminate_on_nan_stops_and_can_raise(caplog):
    x, y = _data()
    x[20] = float("nan")  # in the second global batch (shuffle=False)
    trainer = _trainer()
    history = trainer.fit((x, y), 3, 16, shuffle=False, callbacks=[C.TerminateOnNaN()])
    assert trainer.progress.global_step == 2 and len(history) == 1
    with pytest.raises(FloatingPointError, match="not finite.*1 of 1 replicas.*batch 1"):
        _trainer().fit((x, y), 3, 16, shuffle=False, callbacks=[C.TerminateOnNaN(raise_error=True)])


def test_progress_bar_modes():
    x, y = _data()
    out = io.StringIO()
    _trainer().fit((x, y), 2, 16, callbacks=[C.ProgressBar(stream=out)])  # not a TTY: one line per epoch
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("epoch 1/2: loss") and "examples/s" in lines[0]
    bar = io.StringIO()
    _trainer().fit((x, y), 1, 16, callbacks=[C.ProgressBar(mode="bar", stream=bar)])
    assert "epoch 1/1" in bar.getvalue() and "3/3" in bar.getvalue() and "examples/s" in bar.getvalue()
    off = io.StringIO()
    _trainer().fit((x, y), 1, 16, callbacks=[C.ProgressBar(mode="off", stream=off)])
    assert off.getvalue() == ""
    with pytest.raises(ValueError, match="mode must be one of"):
        C.ProgressBar(mode="fancy")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_without_the_package_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install 'towers\[tensorboard\]'"):
        C.TensorBoard("logs")


def test_backup_and_restore_resumes_at_the_exact_step(tmp_path, caplog):
    x, y = _data(56)

    class Crash(C.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs["global_step"] == 7:
                raise KeyboardInterrupt("simulated crash")

    def run(backup_dir, *extra):
        trainer = _trainer(dropout=True)
        stop = C.EarlyStopping("loss", patience=5)
        history = trainer.fit((x, y), 3, 16, validation_data=(x, y),
                              callbacks=[C.BackupAndRestore(backup_dir, save_freq=3), stop, *extra])
        return trainer, history, stop

    reference, ref_history, ref_stop = run(tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", Crash())
    saved = ckpt.load_checkpoint(tmp_path / "b" / "backup")
    assert (saved["epoch"], saved["step"], saved["global_step"]) == (1, 2, 6)
    torch.manual_seed(1234)  # a restarted process starts with other RNG states
    with _towers_log(caplog):
        resumed, history, stop = run(tmp_path / "b")
    assert "resuming from" in caplog.text
    measured = {k: v for k, v in history.history.items() if k not in THROUGHPUT_KEYS}  # timings differ run to run
    assert measured == {k: v for k, v in ref_history.history.items() if k not in THROUGHPUT_KEYS}
    assert history.epoch == [0, 1, 2]
    assert (stop.wait, stop.best) == (ref_stop.wait, ref_stop.best)
    for a, b in zip(reference.unwrapped_model.parameters(), resumed.unwrapped_model.parameters()):
        assert torch.equal(a, b)
    assert not (tmp_path / "b" / "backup").exists()  # deleted after a successful fit
    with pytest.raises(ValueError, match="save_freq"):
        C.BackupAndRestore(tmp_path, save_freq=0)


def test_resume_with_another_global_batch_and_a_foreign_model(tmp_path, caplog):
    x, y = _data(56)
    trainer = _trainer()
    trainer.fit((x, y), 1, 16, callbacks=[C.BackupAndRestore(tmp_path, save_freq=3, delete_checkpoint=False)])
    state = ckpt.load_checkpoint(tmp_path / "backup")  # saved after 3 of the 4 steps: 48 examples
    assert (state["epoch"], state["step"], state["data"]["examples"]) == (0, 3, 48)
    other = _trainer()
    with _towers_log(caplog, logging.WARNING):
        other.fit((x, y), 1, 20, callbacks=[C.BackupAndRestore(tmp_path, delete_checkpoint=False)])
    assert "examples are seen twice" in caplog.text
    assert other.progress.global_step == 3 + 1  # resumed after 2 batches of 20 (40 <= 48 examples): 1 left
    wrong = Trainer(nn.Linear(4, 3), None, F.cross_entropy, strategy=towers.OneDeviceStrategy("cpu"))
    before = {k: v.clone() for k, v in wrong.unwrapped_model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match="does not fit this model"):
        wrong.load_checkpoint(str(tmp_path / "backup"))
    assert all(torch.equal(v, before[k]) for k, v in wrong.unwrapped_model.state_dict().items())


def test_backup_dir_defaults_to_the_jobs_checkpoint_dir(tmp_path):
    from towers.cluster import ProcessInfo, from_env

    info = from_env({"TOWERS_CHECKPOINT_DIR": str(tmp_path)})
    assert info.checkpoint_dir == str(tmp_path)
    x, y = _data(32)

    def fit(info: ProcessInfo, *callbacks):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 2))
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                          strategy=towers.OneDeviceStrategy("cpu", info=info))
        trainer.fit((x, y), 1, 16, callbacks=list(callbacks))

    fit(info, C.BackupAndRestore(save_freq=1, delete_checkpoint=False))
    assert ckpt.load_checkpoint(tmp_path / "backup" / "backup")["global_step"] == 2
    with pytest.raises(ValueError, match="TOWERS_CHECKPOINT_DIR is unset"):
        fit(from_env({}), C.BackupAndRestore())
