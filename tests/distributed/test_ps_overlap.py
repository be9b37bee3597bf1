"""Async parameter servers with ``overlap=True``: a push's reply is read during the next step.

One worker + one ps task: the parameters follow exactly ``P[k+1] = P[k] - lr * grad_k(P[k-1])`` (one
step of staleness, the documented cost), every push is applied once, and ``state_dict()`` after
the last step holds the ps tasks' values (the pending reply is read first). Two workers + one ps
task: ``Trainer.fit`` on overlapped pushes trains every example of each epoch and learns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers

pytestmark = pytest.mark.timeout(180)

STEPS, LR = 6, 0.3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randn(8, 4, generator=g)
        out.append((x, (x[:, 0] > x[:, 1]).long()))
    return out


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _worker() -> dict | None:
    strategy = towers.ParameterServerStrategy(num_ps=1, mode="async", overlap=True, timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        return None
    model = _net()
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    for x, y in _batches():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.clone() for k, v in strategy.unwrap(model).state_dict().items()}
    stats = strategy.ps_stats()[0]
    strategy.shutdown()
    return {"state": state, "versions": stats["worker_versions"]}


def test_an_overlapped_push_is_one_step_stale_and_nothing_is_lost():
    worker = towers.spawn(_worker, 2, timeout_s=120, env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})[0]
    model = _net()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]  # the parameters the next gradient is taken at
    for x, y in _batches():
        now = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p, n in zip(params, now):
                p.copy_(n - LR * p.grad)
        before = now
    assert worker["versions"] == [STEPS]  # every push applied once
    for (name, got), want in zip(worker["state"].items(), model.state_dict().values()):
        assert torch.allclose(got, want, atol=1e-6), name
