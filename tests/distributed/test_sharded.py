"""FullyShardedStrategy keeps the same-maths promise (invariant 1) at 4 CPU processes and under Trainer.fit at 4 and 2.

(At 2 processes the flagship test, tests/distributed/test_mirrored.py, runs it from the strategy
table like every synchronous strategy.) Custom loop at 4: after k steps the sharded replicas
hold the parameters (gathered from their shards) and report the losses OneDeviceStrategy gets
on the same global batches, with Adam, gradient clipping and an LR scheduler over a ragged last
batch, gradient accumulation (with CPU offload), an empty share (last batch of one example) with
``reshard_after_forward=False``, and HSDP on a 2x2 mesh (shard within pairs, replicate across
them): by default when the 4 processes say they are 2 nodes of 2, and with
``shard_group_size=2``. ``Trainer.fit`` at 4, and at 2 launched as ``--strategy sharded`` would
(TOWERS_STRATEGY), gives one device's History and parameters; bf16 and fp16 (loss-scaled) train
with float32 master shards. The one-device references run in this process; each test is one
spawn; all assertions happen here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.parallel.fsdp import fsdp_modules

pytestmark = pytest.mark.timeout(240)

SPAWN_TIMEOUT_S = 180
ATOL = 1e-5

#: name -> strategy options and training setup; "ref_gbs": the one-device global batch when it differs.
CASES: dict[str, dict] = {
    "adam_schedule_ragged": dict(n=22, gbs=8, optimizer="adam", options={"shard_units": nn.Linear}),
    "accumulation": dict(n=22, gbs=4, optimizer="sgd", ref_gbs=8,
                         options={"gradient_accumulation_steps": 2, "shard_units": nn.Linear, "cpu_offload": True}),
    "empty_share_no_reshard": dict(n=17, gbs=8, optimizer="adam",
                                   options={"reshard_after_forward": False, "shard_units": 50}),
    # 4 processes that say they are 2 nodes of 2: HSDP by default (shard within a node, replicate across).
    "hsdp_2_nodes": dict(n=22, gbs=8, optimizer="adam", options={"shard_units": nn.Linear}, nodes=2),
    "hsdp_explicit": dict(n=22, gbs=4, optimizer="sgd", options={"shard_units": nn.Linear, "shard_group_size": 2}),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5), nn.Tanh(), nn.Linear(5, 3))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _full(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def train(strategy: towers.Strategy, *, n: int, gbs: int, optimizer: str, epochs: int = 2) -> dict:
    """The user's custom loop, unchanged for every strategy; returns the full final state and per-step global losses."""
    with strategy.scope():
        net = _model()
        opt = (torch.optim.Adam(net.parameters(), lr=0.02) if optimizer == "adam"
               else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    net, opt = strategy.prepare(net, opt)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    batches = strategy.distribute_dataset(_data(n), gbs, shuffle=True, seed=3)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"))
        loss.backward()
        if optimizer == "adam":
            strategy.clip_grad_norm_(net.parameters(), 10.0)  # a global norm over the shards; never reached here
        opt.step()
        opt.zero_grad()
        return loss

    losses, shares = [], []
    for _ in range(epochs):
        for x, y in batches:
            shares.append(len(x))
            losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y))))
            if opt.is_update_step:
                schedule.step()
    return {"state": _full(strategy.unwrap(net).state_dict()), "losses": torch.stack(losses), "shares": shares}


def _pretend_nodes(nodes: int) -> ProcessInfo:
    import dataclasses

    info = towers.cluster.from_env()
    per_node = info.world_size // nodes
    return dataclasses.replace(info, local_world_size=per_node, local_rank=info.rank % per_node,
                               node_rank=info.rank // per_node)


def _replica(cases: dict) -> dict:
    results = {}
    for name, case in cases.items():
        info = _pretend_nodes(case["nodes"]) if "nodes" in case else None
        strategy = towers.FullyShardedStrategy(info=info, timeout_s=60, **case["options"])
        results[name] = train(strategy, n=case["n"], gbs=case["gbs"], optimizer=case["optimizer"])
        results[name]["mesh"] = tuple(strategy.mesh.shape)
    results["fit"] = _fit(towers.FullyShardedStrategy(timeout_s=60))  # Trainer.fit at 4 too (defined below)
    return results


def _reference(case: dict) -> dict:
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    return train(strategy, n=case["n"], gbs=case.get("ref_gbs", case["gbs"]), optimizer=case["optimizer"])


def test_sharded_matches_one_device_at_4_processes():
    replicas = 4
    per_rank = towers.spawn(_replica, replicas, args=(CASES,), timeout_s=SPAWN_TIMEOUT_S)
    for name, case in CASES.items():
        ref = _reference(case)
        micro = case["options"].get("gradient_accumulation_steps", 1)
        for rank, result in enumerate(per_rank):
            got = result[name]
            losses = got["losses"]
            if micro > 1:  # a micro-batch's loss is its share of the update's mean: sum them per update
                losses = losses.reshape(-1, micro).sum(dim=1)
            assert torch.allclose(losses, ref["losses"], atol=ATOL), (name, rank, losses, ref["losses"])
            assert got["state"].keys() == ref["state"].keys()
            for key, value in ref["state"].items():
                assert torch.allclose(got["state"][key], value, atol=ATOL), (name, rank, key)
    assert per_rank[0]["adam_schedule_ragged"]["mesh"] == (replicas,)
    assert per_rank[0]["hsdp_2_nodes"]["mesh"] == per_rank[0]["hsdp_explicit"]["mesh"] == (2, 2)
    # The data really was ragged: the last batch of one example left every other replica empty.
    assert [r["empty_share_no_reshard"]["shares"][2] for r in per_rank] == [1] + [0] * (replicas - 1)
    _check_fit(per_rank, _fit(towers.OneDeviceStrategy("cpu", info=ProcessInfo())))


# --- Trainer.fit --------------------------------------------------------------------------------------
N, GBS, EPOCHS = 53, 8, 2  # the last global batch has 5 examples: 3 + 2 on two replicas


def _fit_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return x, (x[:, 0] - x[:, 2] > 0).long()


def _fit(strategy) -> dict:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    x, y = _fit_data()
    history = trainer.fit((x, y), EPOCHS, GBS, validation_data=(x[:29], y[:29]))
    return {"history": history.state_dict(), "state": _full(trainer.unwrapped_model.state_dict())}


def _fit_replica() -> dict:
    strategy = towers.strategy_from_env(timeout_s=60)  # TOWERS_STRATEGY=sharded, as `towers launch --strategy sharded`
    result = {"name": strategy.name, **_fit(strategy)}
    for precision in ("bf16", "fp16"):
        mixed = towers.FullyShardedStrategy(timeout_s=60, precision=precision)
        fitted = _fit(mixed)
        result[precision] = {"loss": fitted["history"]["history"]["loss"], "scale": mixed.precision.scale,
                             "dtypes": sorted({str(v.dtype) for v in fitted["state"].values()})}
    return result


def _check_fit(per_rank: list[dict], ref: dict) -> None:
    for rank, result in enumerate(per_rank):
        got = result["fit"]
        for key, value in ref["state"].items():
            assert torch.allclose(got["state"][key], value, atol=ATOL), (rank, key)
        for metric, values in ref["history"]["history"].items():
            if metric in THROUGHPUT_KEYS:  # measured: differs run to run
                continue
            assert torch.allclose(torch.tensor(got["history"]["history"][metric]), torch.tensor(values),
                                  atol=ATOL), (rank, metric)


def test_trainer_fit_sharded_matches_one_device():
    per_rank = towers.spawn(_fit_replica, 2, timeout_s=SPAWN_TIMEOUT_S, env={"TOWERS_STRATEGY": "sharded"})
    ref = _fit(towers.OneDeviceStrategy("cpu", info=ProcessInfo()))
    assert [got["name"] for got in per_rank] == ["sharded", "sharded"]
    _check_fit([{"fit": got} for got in per_rank], ref)
    for got in per_rank:
        for precision in ("bf16", "fp16"):  # not float32 maths: they train, close to the float32 losses
            assert got[precision]["dtypes"] == ["torch.float32"], precision  # float32 master shards
            loss = got[precision]["loss"]
            assert all(torch.isfinite(torch.tensor(loss))) and loss[-1] < loss[0], precision
            assert abs(loss[-1] - ref["history"]["history"]["loss"][-1]) < 0.05, precision
        assert got["fp16"]["scale"] == 2.0 ** 16  # the loss scale was applied and no step overflowed


class _BlocksAndHead(nn.Module):
    """Repeated blocks in a ModuleList (units under shard_units="auto") and layers of the root's own after them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def _mixed_blocks_replica(precision: str) -> dict:
    torch.manual_seed(0)
    strategy = towers.FullyShardedStrategy(timeout_s=60, precision=precision)
    with strategy.scope():
        net = _BlocksAndHead()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = strategy.prepare(net, opt)
    dtypes = set()

    def step(bx, by):
        out = model(bx)
        dtypes.add(str(out.dtype))
        loss = towers.compute_average_loss(F.cross_entropy(out, by, reduction="none"))
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    losses = [strategy.reduce("sum", strategy.run(step, args=batch)).item()
              for batch in strategy.distribute_dataset(_fit_data(), 16, shuffle=False)]
    return {"losses": losses, "out_dtypes": sorted(dtypes), "units": len(fsdp_modules(net))}


def test_mixed_precision_units_hand_their_outputs_to_the_roots_own_layers():
    # A unit's output stays in the compute dtype: cast to float32, it would not match the root's head weights.
    # (bf16 only: the policy is the same for fp16, whose loss scaling test_trainer_fit_sharded_matches_one_device covers.)
    per_rank = towers.spawn(_mixed_blocks_replica, 2, args=("bf16",), timeout_s=SPAWN_TIMEOUT_S)
    torch.manual_seed(0)
    ref_net = _BlocksAndHead()
    x, y = _fit_data()
    ref_losses = [F.cross_entropy(ref_net(x[:16]), y[:16]).item()]
    for got in per_rank:
        assert got["units"] == 3  # two blocks and the root
        assert got["out_dtypes"] == ["torch.float32"]  # the root's output: losses in float32
        assert all(torch.isfinite(torch.tensor(got["losses"])))
        assert abs(got["losses"][0] - ref_losses[0]) < 0.02 * abs(ref_losses[0]), (got["losses"], ref_losses)
    assert per_rank[0]["losses"] == per_rank[1]["losses"]
