"""What the Trainer does on the host per step: no read-back of a device value between metric reductions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.training._epoch_loop import EpochLoop

_READS = ("item", "tolist", "__float__", "__int__", "__bool__")  # each waits for the device on a GPU


def _reads_during_fit(monkeypatch, steps: int) -> int:
    # One replica on the CPU reduces every step (it is free there); a GPU's Trainer reduces every log_every_n_steps.
    monkeypatch.setattr(EpochLoop, "syncing_is_free", False)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), F.cross_entropy,
                             metrics=["accuracy"], strategy=towers.OneDeviceStrategy("cpu", info=ProcessInfo()),
                             log_every_n_steps=1000)
    x, y = torch.randn(8 * steps, 8), torch.randint(0, 3, (8 * steps,))
    trainer.fit((x, y), epochs=1, global_batch_size=8)  # warm-up: one-time work (FLOPs counted at the first step)
    calls = [0]
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    history = trainer.fit((x, y), epochs=1, global_batch_size=8)
    monkeypatch.undo()
    assert len(history.history["loss"]) == 1 and trainer.progress.global_step == steps
    return calls[0]


def test_a_step_between_metric_reductions_reads_nothing_back_from_the_device(monkeypatch):
    # Reading a device value (loss.item(), float(metric), a bool of a tensor) makes the host wait for the GPU's queue,
    # and a short step is then bound by the host. Between reductions a step must only queue work: the reads of a fit
    # are those of its first and last steps (the reductions) and of its epoch's end, whatever its length.
    assert _reads_during_fit(monkeypatch, 3) == _reads_during_fit(monkeypatch, 12)
