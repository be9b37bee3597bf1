"""Sharded embedding tables on ps tasks: same maths as one device, and the rows survive a restart of the ps tasks.

* ``ParameterServerStrategy(mode="sync")``, 2 workers + 2 ps tasks (rows split over both, the dense
  MLP on the ps too), row-wise SGD; and ``HybridStrategy``, 2 workers + 1 ps task (MLP all-reduced
  among the workers), row-wise Adagrad: k steps of the same custom loop (ragged last batch, ids
  repeated within and across workers) give the losses, MLP and table of one process with a plain
  ``nn.EmbeddingBag`` and ``torch.optim.SGD``/``Adagrad`` (allclose, float32).
* Then ``mode="async", staleness=1`` in the same processes: every row push applied on arrival,
  no worker more than one update ahead.
* The hybrid run saves ``strategy.state_dict`` after the first epoch; a new job (new ps tasks, so
  nothing of the old ones is left) loads it and runs the second epoch: the same parameters, table
  and Adagrad slots as the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.strategies.parameter_server.embeddings import ShardedEmbedding

pytestmark = pytest.mark.timeout(240)

ATOL = 1e-5
ROWS, DIM = 40, 4


class CTR(nn.Module):
    def __init__(self, emb: nn.Module):
        super().__init__()
        self.emb = emb
        self.mlp = nn.Sequential(nn.Linear(DIM, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(-1)


def _data(n: int = 22) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS // 2, (n, 3), generator=g)  # the upper half of the table stays untouched
    return ids, (ids.sum(1) % 3 == 0).float()


def _build(row_optimizer: str, plain: bool) -> tuple[nn.Module, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    table = ShardedEmbedding(ROWS, DIM, mode="mean", optimizer=row_optimizer, lr=0.3, seed=5)
    mlp_seed_model = CTR(table)
    if not plain:
        return mlp_seed_model, [torch.optim.SGD(mlp_seed_model.parameters(), lr=0.2)]
    emb = nn.EmbeddingBag(ROWS, DIM, mode="mean", _weight=table.initial_weight().clone())
    model = CTR(emb)
    model.mlp.load_state_dict(mlp_seed_model.mlp.state_dict())
    row_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[row_optimizer]
    return model, [torch.optim.SGD(model.mlp.parameters(), lr=0.2), row_cls(emb.parameters(), lr=0.3)]


def _table(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    emb = model.emb
    if isinstance(emb, nn.EmbeddingBag):
        state = optimizers[1].state.get(emb.weight, {})
        return {"weight": emb.weight.detach().clone(), **({"sum": state["sum"].clone()} if "sum" in state else {})}
    return {k: v.clone() for k, v in emb.state_dict()["rows"].items()}


def train(strategy: towers.Strategy, row_optimizer: str, *, plain: bool = False, epochs=(0, 1),
          save_after: int | None = None, load: dict | None = None) -> dict:
    """The same custom loop for every strategy; returns losses, MLP parameters and the table."""
    with strategy.scope():
        model, optimizers = _build(row_optimizer, plain)
    prepared = []
    net = model
    for i, opt in enumerate(optimizers):
        net, opt = strategy.prepare(model, opt) if i == 0 else (net, opt)
        prepared.append(opt)
    if load is not None:
        strategy.load_state_dict(load, net, prepared[0])
    batches = strategy.distribute_dataset(_data(), 8, shuffle=True, seed=3)

    def step(ids, y):
        loss = towers.compute_average_loss(F.binary_cross_entropy_with_logits(net(ids), y, reduction="none"))
        loss.backward()
        for opt in prepared:
            opt.step()
            opt.zero_grad()
        return loss

    losses, saved = [], None
    for epoch in range(2):
        batches.set_epoch(epoch) if hasattr(batches, "set_epoch") else None
        for ids, y in batches:
            if epoch in epochs:
                losses.append(strategy.reduce("sum", strategy.run(step, args=(ids, y))))
        if save_after == epoch:
            # what a checkpoint writes to disk at this point (state_dict's tensors are the live ones)
            saved = torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                                 strategy.state_dict(net, prepared[0]))
    user = strategy.unwrap(net)
    return {"losses": torch.stack(losses), "mlp": [p.detach().clone() for p in user.mlp.parameters()],
            "table": _table(user, optimizers), "saved": saved}


def _compare_table(got: dict[str, torch.Tensor], reference: torch.Tensor, initial: torch.Tensor) -> None:
    ids = got["ids"]
    assert set(ids.tolist()) == set(_data()[0].reshape(-1).tolist())  # exactly the rows the data touched
    assert torch.allclose(got["weight"], reference[ids], atol=ATOL), (got["weight"] - reference[ids]).abs().max()
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(reference[untouched], initial[untouched])  # the dense optimizer left them alone too


def _worker(strategy_name: str, row_optimizer: str, save_after: int | None) -> dict | None:
    strategy = towers.get_strategy(strategy_name, mode="sync", timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        out = {"ps": strategy.ps_stats()[0]}
    else:
        out = train(strategy, row_optimizer, save_after=save_after)
        strategy.shutdown()
    # then, in the same processes, one epoch in async mode with a staleness bound
    strategy = towers.get_strategy(strategy_name, mode="async", staleness=1, timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        out["async_ps"] = strategy.ps_stats()[0]
        return out
    out["async_losses"] = train(strategy, row_optimizer, epochs=(0,))["losses"]
    strategy.shutdown()
    return out


def _resume(strategy_name: str, row_optimizer: str, state: dict) -> dict | None:
    strategy = towers.get_strategy(strategy_name, mode="sync", timeout_s=60, exit_on_ps=False)
    if strategy.is_ps:
        return {"ps": strategy.ps_stats()[0]}
    out = train(strategy, row_optimizer, epochs=(1,), load=state)
    strategy.shutdown()
    return out


@pytest.mark.parametrize("strategy_name,num_ps,row_optimizer", [("ps", 2, "sgd"), ("hybrid", 1, "adagrad")])
def test_sync_rows_match_one_device_embedding_bag(strategy_name, num_ps, row_optimizer):
    env = {"TOWERS_STRATEGY": strategy_name, "TOWERS_NUM_PS": str(num_ps)}
    save = 0 if strategy_name == "hybrid" else None
    per_rank = towers.spawn(_worker, 2 + num_ps, args=(strategy_name, row_optimizer, save), timeout_s=150, env=env)
    reference = train(towers.OneDeviceStrategy("cpu", info=ProcessInfo()), row_optimizer, plain=True)
    initial = _build(row_optimizer, True)[0].emb.weight.detach()
    workers, servers = per_rank[:2], [r["ps"] for r in per_rank[2:]]
    # every ps task holds rows; 6 steps = 6 embedding rounds
    assert all(s["embeddings"]["tables"][0]["touched"] > 0 for s in servers)
    assert all(s["embeddings"]["version"] == 6 for s in servers)
    # async: every push applied on arrival (2 workers x 3 steps), never more than 1 update ahead
    for s in (r["async_ps"] for r in per_rank[2:]):
        assert s["mode"] == "async" and s["embeddings"]["version"] == 6 and s["embeddings"]["max_lead"] <= 1
    assert all(torch.isfinite(w["async_losses"]).all() for w in per_rank[:2])
    for got in workers:
        assert torch.allclose(got["losses"], reference["losses"], atol=ATOL), (got["losses"], reference["losses"])
        for a, b in zip(got["mlp"], reference["mlp"]):
            assert torch.allclose(a, b, atol=ATOL)
        _compare_table(got["table"], reference["table"]["weight"], initial)
        if row_optimizer == "adagrad":  # the row slots equal torch's dense Adagrad state on touched rows
            ids = got["table"]["ids"]
            assert torch.allclose(got["table"]["slot_sum"], reference["table"]["sum"][ids], atol=ATOL)
    if strategy_name != "hybrid":
        return
    # a new job (fresh ps tasks: the old ones are gone) resumes from the state saved after epoch 0
    state = workers[0]["saved"]
    assert {"ids", "weight", "slot_sum"} <= set(state["model"]["emb.rows"])
    resumed = towers.spawn(_resume, 3, args=(strategy_name, row_optimizer, state), timeout_s=150, env=env)
    for got in resumed[:2]:
        assert torch.allclose(got["losses"], reference["losses"][3:], atol=ATOL)
        for a, b in zip(got["mlp"], workers[0]["mlp"]):
            assert torch.allclose(a, b, atol=ATOL)
        for key, value in workers[0]["table"].items():
            assert torch.allclose(got["table"][key], value, atol=ATOL), key
