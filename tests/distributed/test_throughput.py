"""Throughput and MFU on 2 Mirrored replicas: every rank's History holds the chief's numbers, FLOPs per example
are the hand count on each replica's share, and MFU divides by both replicas' peaks (Trainer and custom loop)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers

pytestmark = pytest.mark.timeout(180)

# Linear(16, 32) -> ReLU -> Linear(32, 4), per example: forward 2*(16*32 + 32*4) = 1,280; backward: the weight
# gradients of both layers (1,280) and the input gradient of the second (2*32*4 = 256); the input needs none.
FLOPS_PER_EXAMPLE = 2 * (16 * 32 + 32 * 4) * 2 + 2 * 32 * 4  # 2,816


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _replica():
    torch.set_num_threads(1)
    strategy = towers.strategy_from_env()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, strategy=strategy)
    history = trainer.fit((x, y), 2, 16)  # 6 steps of 8 + 8 examples per epoch
    out = {"history": history.state_dict(), "flops": trainer.throughput.flops_per_example}

    # The custom loop: a meter on the same strategy, over distribute_dataset's batches (global accounting).
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = strategy.prepare(model, optimizer)

    def step(xb, yb):
        loss = towers.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none"))
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    meter = towers.ThroughputMeter(strategy, peak_flops=1e12)
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=16):
        with meter.step((xb, yb)):
            strategy.run(step, args=(xb, yb))
    out["loop"] = meter.summary(synchronize=True)
    out["loop_flops"] = meter.flops_per_example
    strategy.barrier()
    return out


def test_two_replicas_log_the_chiefs_throughput_and_mfu_over_both_devices():
    results = towers.spawn(_replica, 2, timeout_s=150, env={"TOWERS_STRATEGY": "mirrored"})
    h0, h1 = results[0]["history"], results[1]["history"]
    assert h0 == h1  # the chief's clock, on every replica
    for epoch in range(2):
        assert h0["history"]["examples_per_second"][epoch] > 0
        assert 0 < h0["history"]["mfu"][epoch] <= 1
    assert "tokens_per_second" not in h0["history"]
    for r in results:  # each replica counted its own share of 8; per example, the hand count
        assert r["flops"] == pytest.approx(FLOPS_PER_EXAMPLE, rel=0.05)
        assert r["loop_flops"] == pytest.approx(FLOPS_PER_EXAMPLE, rel=0.05)
        eps = r["loop"]["examples_per_second"]  # global examples: 16 per step
        assert r["loop"]["mfu"] == pytest.approx(eps * r["loop_flops"] / (2 * 1e12))
