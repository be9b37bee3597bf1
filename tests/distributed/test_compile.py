"""Compiled models under Mirrored: DDP first, then torch.compile; the one-device maths within compile's tolerance.

The custom loop and ``Trainer.fit`` both run with ``compile={"backend": "aot_eager"}`` (TorchDynamo
traces the DDP-wrapped model and splits it at the gradient buckets; aot_eager skips C++ code
generation, which would take a minute per process on these 2 cores) on 2 replicas and are
compared with uncompiled OneDeviceStrategy runs in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(240)

ATOL = 1e-5
COMPILE = {"backend": "aot_eager"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(22, 1, 6, 6, generator=g), torch.randint(0, 3, (22,), generator=g)


def train(strategy: towers.Strategy, compile) -> dict:
    net = _model()
    model, optimizer = strategy.prepare(net, torch.optim.Adam(net.parameters(), lr=0.01), compile=compile)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = [strategy.reduce("sum", strategy.run(step, args=(x, y)))
              for _ in range(2) for x, y in strategy.distribute_dataset(_data(), 8, seed=3)]
    trainer_net = _model()
    trainer = towers.Trainer(trainer_net, torch.optim.SGD(trainer_net.parameters(), lr=0.1), F.cross_entropy,
                             strategy=strategy, compile=compile)
    history = trainer.fit(_data(), epochs=2, global_batch_size=8)
    return {"params": [p.detach().clone() for p in strategy.unwrap(model).parameters()],
            "losses": torch.stack(losses), "fit_params": [p.detach().clone() for p in trainer_net.parameters()],
            "history": history.history["loss"]}


def _replica() -> dict:
    return train(towers.MirroredStrategy(timeout_s=60), COMPILE)


def test_compiled_mirrored_matches_one_device():
    per_rank = towers.spawn(_replica, 2, timeout_s=200)
    reference = train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()), False)
    for rank, got in enumerate(per_rank):
        assert torch.allclose(got["losses"], reference["losses"], atol=ATOL), rank
        for key in ("params", "fit_params"):
            for a, b in zip(got[key], reference[key]):
                assert torch.allclose(a, b, atol=ATOL), (rank, key)
        assert got["history"] == pytest.approx(reference["history"], abs=ATOL)
