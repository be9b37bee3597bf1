"""ParameterServerStrategy on real processes: sync maths, async staleness, model checks.

* sync, 2 workers + 2 ps tasks (the model is sharded across both): k steps of the unchanged custom
  loop (ragged last batch, two Adam param groups, an LR scheduler) give the parameters, losses and
  optimizer state of OneDeviceStrategy on the global batch and of MirroredStrategy on 2 replicas;
  saving and loading the model and optimizer state mid-run replays the same steps exactly.
* async, 2 workers + 1 ps: with ``staleness=1`` the fast worker never gets more than one applied
  update ahead of the slow one (versions counted on the ps); without a bound it does; training
  converges; a worker whose model differs from the chief's gets a clear error at ``prepare``.

One spawn per topology; every assertion runs here, on returned values.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(240)

ATOL = 1e-5
PS_ENV = {"TOWERS_STRATEGY": "ps"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(n: int = 22) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(strategy: towers.Strategy, *, epochs: int = 2, replay: bool = False) -> dict:
    """The user's custom loop, the same for every strategy; returns parameters, losses and optimizer state."""
    with strategy.scope():
        net = _model()
        optimizer = torch.optim.Adam([{"params": net[0].parameters(), "lr": 0.02},
                                      {"params": [*net[3].parameters(), *net[5].parameters()]}], lr=0.01)
    net, optimizer = strategy.prepare(net, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    batches = strategy.distribute_dataset(_data(), 8, shuffle=True, seed=3)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        return loss

    losses = []
    for _ in range(epochs):
        for x, y in batches:
            losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y))))
    model = strategy.unwrap(net)
    out = {"params": [p.detach().clone() for p in model.parameters()], "losses": torch.stack(losses),
           "optimizer": optimizer.state_dict(), "lr": [g["lr"] for g in optimizer.param_groups]}
    if replay:  # checkpoint round trip: save, take an epoch, load, take the same epoch again
        saved = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict(), scheduler.state_dict())
        epoch = list(batches)
        runs = []
        for _ in range(2):
            for x, y in epoch:
                strategy.run(step, args=(x, y))
            runs.append([p.detach().clone() for p in model.parameters()])
            model.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            scheduler.load_state_dict(saved[2])
        out["replay"] = runs
    return out


def _ps_sync_worker() -> dict | None:
    strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        return {"ps": strategy.ps_stats()[0]}
    result = train(strategy, replay=True)
    result["stats"] = strategy.ps_stats()
    strategy.shutdown()
    return result


def _mirrored_worker() -> dict:
    return train(towers.MirroredStrategy(timeout_s=60))


def test_sync_matches_one_device_and_mirrored():
    per_rank = towers.spawn(_ps_sync_worker, 4, timeout_s=150, env={**PS_ENV, "TOWERS_NUM_PS": "2"})
    mirrored = towers.spawn(_mirrored_worker, 2, timeout_s=120)
    reference = train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()))
    workers, servers = per_rank[:2], [r["ps"] for r in per_rank[2:]]
    # both ps tasks hold part of the model: 6 steps, one version per round, both workers in every round
    assert all(s["num_params"] > 0 for s in servers) and sum(s["num_params"] for s in servers) == 6
    for s in servers:
        assert s["mode"] == "sync" and s["version"] == 6 + 2 * 3 and s["dead"] == {}
    for rank, got in enumerate([*workers, *mirrored]):
        assert torch.allclose(got["losses"], reference["losses"], atol=ATOL), (rank, got["losses"], reference["losses"])
        for a, b in zip(got["params"], reference["params"]):
            assert torch.allclose(a, b, atol=ATOL), rank
    for got in workers:
        assert got["lr"] == reference["lr"]  # the scheduler's lr reached the ps tasks' optimizers
        ref_state, state = reference["optimizer"], got["optimizer"]
        assert state["param_groups"] == ref_state["param_groups"]
        assert state["state"].keys() == ref_state["state"].keys()
        for index, values in ref_state["state"].items():
            for key, value in values.items():
                assert torch.allclose(state["state"][index][key].double(), value.double(), atol=ATOL), (index, key)
        first, second = got["replay"]
        assert all(torch.equal(a, b) for a, b in zip(first, second))  # load_state_dict reached the ps tasks


def _ps_async_worker(slow_s: float) -> dict | None:
    result: dict = {}
    for staleness in (1, None):
        strategy = towers.strategy_from_env(mode="async", staleness=staleness, timeout_s=60, exit_on_ps=False)
        if strategy.is_ps:
            result[staleness] = strategy.ps_stats()[0]
            continue
        if strategy.replica_id == 1 and staleness == 1:
            try:  # a model that differs from the chief's is refused at registration
                strategy.prepare(nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 2)))
            except ValueError as exc:
                result["mismatch"] = str(exc)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        net, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.2))
        g = torch.Generator().manual_seed(strategy.replica_id)
        losses = []
        for _ in range(30):
            x = torch.randn(16, 4, generator=g)
            y = (x[:, 0] + x[:, 1] > 0).long()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if strategy.replica_id == 1 and staleness is None and len(losses) == 1:
                # Unbounded, the fast worker runs ahead: wait (on the ps's count, not on a clock that a busy machine
                # stretches) until it is 5 versions in, so its lead of more than 3 is a fact, not a race.
                deadline = time.monotonic() + 60
                while strategy.ps_stats()[0]["worker_versions"][0] < 5 and time.monotonic() < deadline:
                    time.sleep(0.01)  # polling the outcome, bounded by the deadline
            elif strategy.replica_id == 1:
                time.sleep(slow_s)  # bounded: the fast worker waits for this one (max_lead <= 1 whatever the timing)
        mean_first = strategy.reduce("mean", torch.tensor(sum(losses[:5]) / 5))
        mean_last = strategy.reduce("mean", torch.tensor(sum(losses[-5:]) / 5))
        strategy.barrier()
        result[staleness] = {"first": mean_first.item(), "last": mean_last.item(), "stats": strategy.ps_stats()[0]}
        strategy.shutdown()
    return result


def test_async_staleness_bound_versions_and_model_check():
    per_rank = towers.spawn(_ps_async_worker, 3, args=(0.02,), timeout_s=150, env={**PS_ENV, "TOWERS_NUM_PS": "1"})
    chief, slow, ps = per_rank
    bounded, free = ps[1], ps[None]
    for stats in (bounded, free):  # every push applied exactly once, counted per worker
        assert stats["worker_versions"] == [30, 30] and stats["version"] == 60 and stats["dead"] == {}
    assert bounded["max_lead"] <= 1, bounded
    assert free["max_lead"] > 3, free  # without the bound the fast worker runs ahead
    for result in (chief, slow):
        assert result[1]["last"] < 0.8 * result[1]["first"]  # async training converges
        assert result[1]["first"] == pytest.approx(chief[1]["first"])  # reduce: the same value on every worker
    assert "worker 1 (rank 1)'s model does not match the model the chief registered" in slow["mismatch"]
    assert "expected '0.weight' (16, 4) float32, received '0.weight' (7, 4) float32" in slow["mismatch"]
