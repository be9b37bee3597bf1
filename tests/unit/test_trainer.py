"""Trainer on one device: fit/evaluate/predict, same maths as the custom loop, validation of inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.training import Trainer


def _data(n: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()


def _trainer(loss=F.cross_entropy, lr: float = 0.1, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=lr), loss, metrics=["accuracy"],
                   strategy=towers.OneDeviceStrategy("cpu"), **kwargs)


def test_fit_evaluate_predict():
    x, y = _data()
    trainer = _trainer()
    history = trainer.fit((x, y), 4, 16, validation_data=(x, y))
    assert history.epoch == [0, 1, 2, 3] and trainer.history is history
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples", "val_examples",
                                    "examples_per_second", "mfu"}
    assert history["loss"][-1] < history["loss"][0]
    assert trainer.progress.global_step == 4 * 4  # 50 examples / 16 = 4 batches, the last one partial
    result = trainer.evaluate((x, y), 7)  # another batch size: the same example-weighted means
    assert result["loss"] == pytest.approx(history["val_loss"][-1], rel=1e-6)
    assert result["accuracy"] == pytest.approx(history["val_accuracy"][-1])
    with torch.no_grad():
        expected = F.cross_entropy(trainer.unwrapped_model(x), y).item()
        logits = trainer.unwrapped_model(x)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
    assert torch.allclose(trainer.predict(x, batch_size=8), logits)
    assert torch.allclose(trainer.predict(torch.utils.data.TensorDataset(x, y)), logits)


def test_fit_is_the_custom_loop():
    """One epoch of fit gives the parameters of the README's loop (same order, same global batches)."""
    x, y = _data()
    trainer = _trainer()
    trainer.fit((x, y), 2, 16, shuffle=True)
    strategy = towers.OneDeviceStrategy("cpu")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = strategy.distribute_dataset(torch.utils.data.TensorDataset(x, y), 16, shuffle=True, seed=0)

    def step(xb, yb):
        loss = towers.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):
        for xb, yb in batches:
            strategy.run(step, args=(xb, yb))
    for a, b in zip(trainer.unwrapped_model.parameters(), strategy.unwrap(model).parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_loss_module_and_steps_per_epoch():
    x, y = _data()
    by_function = _trainer().fit((x, y), 2, 10, steps_per_epoch=3)
    module = _trainer(loss=nn.CrossEntropyLoss())
    by_module = module.fit((x, y), 2, 10, steps_per_epoch=3)
    assert by_module.history.keys() == by_function.history.keys()
    for key in by_function.history.keys() - set(THROUGHPUT_KEYS):  # timings differ run to run
        assert by_module[key] == by_function[key], key
    assert module.progress.global_step == 6


def test_default_strategy_and_bad_inputs():
    x, y = _data()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    assert trainer.strategy.name == "one_device" and trainer.strategy.num_replicas_in_sync == 1
    with pytest.raises(ValueError, match="epochs must be an integer >= 1. Received: epochs=-1"):
        trainer.fit((x, y), -1, 8)
    with pytest.raises(ValueError, match="global_batch_size must be an integer >= 1"):
        trainer.fit((x, y), 1, 0)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        trainer.fit((x, y), 1, 8, steps_per_epoch=0)
    for bad in (0, True):  # not silently replaced by the default
        with pytest.raises(ValueError, match="global_batch_size must be a positive integer.*Received"):
            trainer.evaluate((x, y), global_batch_size=bad)
    with pytest.raises(TypeError, match="train_data must be a map-style Dataset"):
        trainer.fit(42, 1, 8)
    with pytest.raises(ValueError, match="x and y must have the same length"):
        trainer.fit((x, y[:3]), 1, 8)
    with pytest.raises(TypeError, match="loss must be a callable"):
        Trainer(nn.Linear(4, 2), None, "mse", strategy=towers.OneDeviceStrategy("cpu"))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Trainer("model", None, F.cross_entropy, strategy=towers.OneDeviceStrategy("cpu"))
    with pytest.raises(RuntimeError, match=r"Trainer.fit needs an optimizer. Received: Trainer\(model, optimizer=None"):
        Trainer(nn.Linear(4, 2), None, F.cross_entropy, strategy=towers.OneDeviceStrategy("cpu")).fit((x, y), 1, 8)
    # A loss that returns its batch's mean (ignoring reduction=) trains the per-example loss's update, not a refusal.
    scalar, per_example = _trainer(loss=lambda p, t, reduction="mean": F.cross_entropy(p, t)), _trainer()
    scalar.fit((x, y), 1, 8)
    per_example.fit((x, y), 1, 8)
    for a, b in zip(scalar.model.parameters(), per_example.model.parameters()):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # and evaluate reports plain torch's mean over the data
        plain = float(F.cross_entropy(scalar.model(x), y))
    assert scalar.evaluate((x, y), global_batch_size=8)["loss"] == pytest.approx(plain, rel=1e-5)


def test_precision_belongs_to_the_strategy():
    with pytest.raises(ValueError, match="Precision belongs to the strategy"):
        _trainer(precision="bf16")
    assert _trainer(precision="32").strategy.precision.name == "32"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    bf16 = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, precision="bf16")
    assert bf16.strategy.precision.name == "bf16"
    x, y = _data()
    assert len(bf16.fit((x, y), 1, 16)) == 1


def test_a_micro_batch_without_labels_adds_nothing_not_nan():
    # nanoGPT's convention (a mean over targets != -1, no num_items_in_batch): a micro-batch whose targets are all
    # padding has a NaN mean; it must add a zero gradient and no loss, so accumulation equals one big batch.
    from towers.models_gpt import GPT, GPTConfig

    idx = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)
    targets[2:] = -1  # rows 2..3: the second micro-batch has no label at all

    class MaskedMean(nn.Module):  # a hand-written token mean: 0/0 without labels, a NaN gradient too
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

        def forward(self, idx, targets):
            logits = self.head(self.embed(idx))
            keep = (targets != -1).float()
            per_token = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
            return logits, (per_token * keep).sum() / keep.sum()

    def train(accumulation: int, kind: str) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=20, block_size=6, n_layer=1, n_head=1, n_embd=8)) if kind == "gpt" else MaskedMean()
        strategy = towers.OneDeviceStrategy("cpu", gradient_accumulation_steps=accumulation)
        trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), strategy=strategy, ignore_index=-1)
        history = trainer.fit((idx, targets), epochs=1, global_batch_size=4 // accumulation, shuffle=False)
        return [p.detach().clone() for p in model.parameters()], history.history

    for kind in ("gpt", "masked mean"):
        (one, one_logs), (two, two_logs) = train(1, kind), train(2, kind)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one, two)), kind
        assert two_logs["loss"] == pytest.approx(one_logs["loss"]) and math.isfinite(two_logs["loss"][0]), kind


class _JobInput:
    """A DistributedDataset whose position is a job's committed steps, as under FaultTolerantStrategy: it yields
    global batch ``s mod len`` of epoch ``s // len`` while the job is at step ``s``, and each batch's position says
    whether its step committed."""

    examples_trained = None
    in_ledger = False

    def __init__(self, strategy: "_JobStrategy", inner: towers.data.DistributedDataset):
        self.strategy, self.inner, self._epoch = strategy, inner, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.inner.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def position_from(self, epoch: int, step: int, *, steps_per_epoch=None) -> tuple[int, int]:
        return divmod(self.strategy.job_step, self.batches_per_epoch)

    def iter_from(self, batch: int):
        from dataclasses import replace

        from towers.data._batch import JobPosition, attach_batch_info, batch_info

        while self.strategy.job_step // self.batches_per_epoch == self._epoch:
            step = self.strategy.job_step
            self.inner.set_epoch(self._epoch)
            x, y = next(iter(self.inner.iter_from(step % self.batches_per_epoch)))
            position = JobPosition(self._epoch, step % self.batches_per_epoch,
                                   committed=lambda step=step: self.strategy.job_step > step)
            info = replace(batch_info(x), position=position)
            yield attach_batch_info(x, info), attach_batch_info(y, info)

    def __iter__(self):
        return self.iter_from(0)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        pass


class _VotingOptimizer:
    """Steps the user's optimizer when the fake job commits the step (not at the steps in ``fail_at``, once each)."""

    def __init__(self, strategy: "_JobStrategy", optimizer: torch.optim.Optimizer):
        self.strategy, self.optimizer = strategy, optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        if self.strategy.job_step in self.strategy.fail_at:
            self.strategy.fail_at.discard(self.strategy.job_step)  # dropped: the same batch comes again
            return
        self.optimizer.step()
        self.strategy.job_step += 1


class _JobStrategy(towers.OneDeviceStrategy):
    """One device in a job that is at committed step ``start_step`` (a group that joined a running job)."""

    def __init__(self, start_step: int = 0, fail_at=()):
        super().__init__("cpu")
        self.job_step, self.fail_at = start_step, set(fail_at)

    def prepare(self, model, optimizer=None, **kwargs):
        model, optimizer = super().prepare(model, optimizer, **kwargs)
        return model, _VotingOptimizer(self, optimizer)

    def distribute_dataset(self, dataset, global_batch_size, **kwargs):
        return _JobInput(self, super().distribute_dataset(dataset, global_batch_size, **kwargs))


def _trainer_on(strategy, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, metrics=["accuracy"],
                   strategy=strategy, **kwargs)


def test_fit_follows_the_jobs_committed_steps():
    """An input whose position is the job's: steps that did not commit count nowhere, a late joiner starts mid-job."""
    x, y = _data()  # 50 examples, 16 per step: 4 steps per epoch, the last of 2
    plain = _trainer_on(towers.OneDeviceStrategy("cpu"), log_every_n_steps=2)
    expected = plain.fit((x, y), 3, 16).history
    # Steps 1, 3 (the end of epoch 0) and 6 do not commit once each: retried, they change nothing.
    job = _trainer_on(_JobStrategy(fail_at={1, 3, 6}), log_every_n_steps=2)
    history = job.fit((x, y), 3, 16)
    assert history.history.keys() == expected.keys()
    for key, values in expected.items():
        if key not in THROUGHPUT_KEYS:  # timings differ run to run
            assert history[key] == pytest.approx(values), key
    assert history["examples"] == [50.0] * 3 and job.progress.global_step == 12
    for a, b in zip(job.unwrapped_model.parameters(), plain.unwrapped_model.parameters()):
        assert torch.equal(a, b)

    epochs_begun = []

    class Epochs(towers.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_begun.append((epoch, self.trainer.progress.step))

    joiner = _trainer_on(_JobStrategy(start_step=6))  # the job is in epoch 1, at its step 2
    history = joiner.fit((x, y), 3, 16, callbacks=[Epochs()])
    assert epochs_begun == [(1, 2), (2, 0)]  # the job's epoch and step, not epoch 0
    assert history.epoch == [1, 2] and history["examples"] == [50.0, 50.0] and joiner.progress.global_step == 12
    ahead = _trainer_on(_JobStrategy(start_step=6))  # an initial_epoch ahead of the job gives way to the job's
    assert ahead.fit((x, y), 3, 16, initial_epoch=2).epoch == [1, 2] and ahead.progress.global_step == 12
    finished = _trainer_on(_JobStrategy(start_step=12))  # the job trained every epoch already
    assert finished.fit((x, y), 3, 16).epoch == [] and finished.progress.global_step == 12
    # An input whose epochs are the job's cannot end early: the fit stops there, at its next epoch, not in a loop.
    with pytest.raises(ValueError, match=r"position is behind the epoch this fit is in.*Received: the input's epoch 0, "
                                         r"step 2; the fit's epoch 1, steps_per_epoch=2"):
        _trainer_on(_JobStrategy()).fit((x, y), 3, 16, steps_per_epoch=2)


class _LosingStrategy(towers.OneDeviceStrategy):
    """One device whose reductions raise PeerLostError after the global steps in ``fail_after``."""

    def __init__(self, fail_after):
        super().__init__("cpu")
        self.fail_after, self.trainer = set(fail_after), None

    def reduce(self, op, value, axis=None):
        if self.trainer.progress.global_step in self.fail_after:
            raise towers.strategies.PeerLostError("replica group 0: strategy.reduce failed: a peer was lost")
        return super().reduce(op, value, axis)


def test_a_peer_lost_during_a_reduction_keeps_training(caplog):
    x, y = _data()
    plain = _trainer_on(towers.OneDeviceStrategy("cpu"))
    expected = plain.fit((x, y), 2, 16).history
    strategy = _LosingStrategy(fail_after={2, 8})  # mid-epoch 0, and the last step of epoch 1
    trainer = _trainer_on(strategy)
    strategy.trainer = trainer
    with caplog.at_level("WARNING", logger="towers"):
        history = trainer.fit((x, y), 2, 16)
    assert "training metrics not reduced at global step 2" in caplog.text
    assert history["examples"] == [50.0, 50.0] and trainer.progress.global_step == 8
    assert history["loss"][0] == pytest.approx(expected["loss"][0])  # step 2's sums joined step 3's reduction
    assert history["loss"][1] != pytest.approx(expected["loss"][1])  # the epoch's last steps' sums never reduced
    for a, b in zip(trainer.unwrapped_model.parameters(), plain.unwrapped_model.parameters()):
        assert torch.equal(a, b)

    class StopAtStep2(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs["global_step"] == 2:
                self.trainer.stop_training = True

    strategy = _LosingStrategy(fail_after={2})
    trainer = _trainer_on(strategy)
    strategy.trainer = trainer
    trainer.fit((x, y), 2, 16, callbacks=[StopAtStep2()])
    assert trainer.progress.global_step == 3  # not decided at step 2 (no reduction): at the next one, everywhere


def test_the_label_count_of_a_moved_batch_is_read_from_its_host_copy():
    # A batch moved to a device keeps its host tensors, so counting labels does not wait for the device's queue
    # (on a GPU that wait stalled every step of a token-loss model). A meta tensor holds no values: counting it
    # would fail, so the count below can only come from the host copy.
    from towers.data._batch import host_copy, to_device
    from towers.training.batches import label_count, split

    idx = torch.randint(0, 10, (4, 6))
    targets = idx.clone()
    targets[0, :4] = -1
    for batch in ((idx, targets), {"input_ids": idx, "labels": targets}):
        moved = to_device(batch, torch.device("meta"))
        parts = split(moved, with_labels_in_inputs=True)
        assert parts.labels.device.type == "meta" and host_copy(parts.labels) is targets
        assert label_count(parts, -1) == 20
    assert label_count(split((idx, targets)), -1) == 20 and host_copy(targets) is None  # not moved: counted in place
