"""Trainer on 2 Mirrored replicas: the same History and metrics on every rank, equal to one device;
early stopping and a NaN on ONE rank stop every rank together; files are written by the chief only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.diagnostics.throughput import THROUGHPUT_KEYS

N, GBS, EPOCHS = 53, 8, 3  # the last global batch has 5 examples: 3 + 2 on two replicas


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return x, (x[:, 0] - x[:, 2] > 0).long()


def _trainer(strategy, **options):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    return towers.Trainer(model, optimizer, F.cross_entropy, metrics=["accuracy", "top2_accuracy"], strategy=strategy,
                          **options)


def _fit_and_evaluate(strategy, out_dir=None):
    x, y = _data()
    trainer = _trainer(strategy)
    callbacks = []
    if out_dir is not None:
        rank = strategy.replica_id
        callbacks = [towers.callbacks.CSVLogger(f"{out_dir}/log-rank{rank}.csv"),
                     towers.callbacks.ModelCheckpoint(f"{out_dir}/model-rank{rank}-{{epoch}}.pt")]
    history = trainer.fit((x, y), EPOCHS, GBS, validation_data=(x[:29], y[:29]), callbacks=callbacks)
    evaluation = trainer.evaluate((x, y), 6)  # 53 = 8 batches of 6 and one of 5, split 3 + 3 / 3 + 2
    params = [p.detach().cpu().clone() for p in trainer.unwrapped_model.parameters()]
    return history.state_dict(), evaluation, params


def _replica(out_dir):
    strategy = towers.strategy_from_env()
    rank = strategy.replica_id
    result = {"strategy": strategy.name, "replicas": strategy.num_replicas_in_sync}
    result["fit"] = _fit_and_evaluate(strategy, out_dir)

    # Early stopping: decided from reduced logs, so every rank stops after the same epoch.
    x, y = _data()
    stop = towers.callbacks.EarlyStopping("val_loss", patience=0, min_delta=10.0)
    result["early"] = len(_trainer(strategy).fit((x, y), 10, GBS, validation_data=(x, y), callbacks=[stop]))

    # A NaN in ONE rank's share only (global batch 2 = examples 16..23; rank 1 holds 20..23).
    x_nan = x.clone()
    x_nan[21] = float("nan")
    seen = []

    class Spy(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs["nonfinite_replicas"])

    trainer = _trainer(strategy, log_every_n_steps=1)  # reduce every step: the stop comes at the NaN step itself
    nan_history = trainer.fit((x_nan, y), 3, GBS, shuffle=False, callbacks=[towers.callbacks.TerminateOnNaN(), Spy()])
    result["nan"] = {"global_step": trainer.progress.global_step, "epochs": len(nan_history), "flags": seen,
                     "rank": rank}
    strategy.barrier()
    return result


def test_two_replicas_share_one_history_equal_to_one_device(tmp_path):
    results = towers.spawn(_replica, 2, args=(str(tmp_path),), timeout_s=180,
                           env={"TOWERS_STRATEGY": "mirrored"})
    assert [r["strategy"] for r in results] == ["mirrored", "mirrored"] and results[0]["replicas"] == 2
    (h0, e0, p0), (h1, e1, p1) = results[0]["fit"], results[1]["fit"]
    assert h0 == h1 and e0 == e1  # bit-identical on every rank: the values were reduced
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))

    # The same maths as one device with the global batch (uneven last batches included).
    h_one, e_one, p_one = _fit_and_evaluate(towers.OneDeviceStrategy("cpu"))
    assert h0["epoch"] == h_one["epoch"] == [0, 1, 2]
    for key, values in h_one["history"].items():
        if key in THROUGHPUT_KEYS:  # measured: differs run to run
            continue
        assert h0["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    assert e0 == pytest.approx(e_one, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(p0, p_one))

    assert [r["early"] for r in results] == [2, 2]
    for r in results:  # both ranks stop after the step where rank 1 alone saw NaN (epoch end still runs, as in Keras)
        assert r["nan"]["global_step"] == 3 and r["nan"]["epochs"] == 1
        assert r["nan"]["flags"] == [0.0, 0.0, 1.0]

    files = sorted(os.listdir(tmp_path))  # the chief's names: rank 1 wrote its part of each checkpoint there
    assert [f for f in files if not f.startswith(".")] == ["log-rank0.csv", "model-rank0-1.pt", "model-rank0-2.pt",
                                                           "model-rank0-3.pt"]
    assert all(f.startswith(".model-rank0-") for f in files if f.startswith("."))  # each checkpoint's directory
    assert len(open(tmp_path / "log-rank0.csv").read().splitlines()) == EPOCHS + 1


def _stop_replica():
    strategy = towers.strategy_from_env()
    x, y = _data()
    x_nan = x.clone()
    x_nan[21] = float("nan")  # in global step 3, in the last replica's share only
    out = {}
    for every in (1, 2, 10):
        trainer = _trainer(strategy, log_every_n_steps=every)
        trainer.fit((x_nan, y), 3, GBS, shuffle=False, callbacks=[towers.callbacks.TerminateOnNaN()])
        out[("nan", every)] = trainer.progress.global_step

        class StopHere(towers.callbacks.Callback):  # a decision taken on ONE replica only
            def on_train_batch_end(self, batch, logs=None):
                if strategy.replica_id == strategy.num_replicas_in_sync - 1 and batch == 1:
                    self.trainer.stop_training = True

        trainer = _trainer(strategy, log_every_n_steps=every)
        history = trainer.fit((x, y), 3, GBS, shuffle=False, callbacks=[StopHere()])
        out[("local", every)] = (trainer.progress.global_step, len(history))
    strategy.barrier()
    return out


@pytest.mark.parametrize("replicas", [2, 4])
def test_stop_decisions_stop_every_replica_at_the_same_step(replicas):
    results = towers.spawn(_stop_replica, replicas, timeout_s=180, env={"TOWERS_STRATEGY": "mirrored"})
    assert all(r == results[0] for r in results[1:])  # the same step on every replica
    steps = -(-N // GBS)  # steps per epoch
    for every, nan_step, local_step in ((1, 3, 2), (2, 3, 3), (10, steps, steps)):
        # NaN in step 3 / a stop set at step 2 on one replica: taken at the first reduction from there on
        assert results[0][("nan", every)] == nan_step, every
        assert results[0][("local", every)] == (local_step, 1), every


def _ps_replica():
    strategy = towers.strategy_from_env(mode="sync", exit_on_ps=False)
    if strategy.is_ps:
        return None  # the ps task served until both workers were done
    try:
        return _fit_and_evaluate(strategy)
    finally:
        strategy.shutdown()


def test_the_same_trainer_under_sync_parameter_servers():
    """Nothing strategy-specific in the Trainer: 2 workers + 1 ps (sync) give one device's History."""
    results = towers.spawn(_ps_replica, 3, timeout_s=180, env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})
    assert results[2] is None
    (h0, e0, p0), (h1, e1, _) = results[0], results[1]
    assert h0 == h1 and e0 == e1
    h_one, e_one, p_one = _fit_and_evaluate(towers.OneDeviceStrategy("cpu"))
    for key, values in h_one["history"].items():
        if key in THROUGHPUT_KEYS:  # measured: differs run to run
            continue
        assert h0["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), key
    assert e0 == pytest.approx(e_one, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(p0, p_one))
