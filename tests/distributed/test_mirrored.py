"""The flagship test (invariant 1): every synchronous strategy in the strategy table (Mirrored,
MultiWorkerMirrored, parameter servers in sync mode, ...) on 2 CPU replicas, and Mirrored on 3,
gives the same parameters and losses after k steps as OneDeviceStrategy on the same global batches.
The strategies come from the table (``towers.cluster.roles.STRATEGIES``): a new strategy with a
``same_maths_options`` entry is tested here without a line of this file changing.

Cases: a ragged last batch (22 examples, global batch 8 -> 8, 8, 6); a last batch of ONE example
(one or two replicas get an empty share); gradient accumulation (micro-batches of 4, two per
update) against one device taking batches of 8 without accumulation; SyncBatchNorm against plain
BatchNorm on one device over the global batch (parameters and running statistics), also with an
empty share; and a model that cannot take an empty batch, with ``pad_empty_batches``. Cases that need
an option run for the strategies whose constructor takes it. The one-device reference runs in this
process; each strategy and replica count is one spawn that runs every case and returns parameters
and losses; all assertions happen here.

The bit-for-bit variant: the strategies that take ``bitwise=True`` run the same cases (but SyncBatchNorm, which it
refuses) against one process with the same micro-batches, compared with ``torch.equal``.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster import roles
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(240)

SPAWN_TIMEOUT_S = 180
ATOL = 1e-5

#: name -> (mirrored options, training setup, one-device reference setup)
CASES: dict[str, dict] = {
    "ragged_last_batch": dict(n=22, gbs=8, model="cnn"),
    "one_example_last_batch": dict(n=17, gbs=8, model="cnn"),
    "accumulation": dict(n=22, gbs=4, model="cnn", options={"gradient_accumulation_steps": 2}, ref_gbs=8),
    "sync_batchnorm": dict(n=22, gbs=8, model="bn", options={"sync_batchnorm": True}),
    "sync_batchnorm_empty_share": dict(n=17, gbs=8, model="bn", options={"sync_batchnorm": True}),
    # A model that cannot take an empty batch (x.view(len(x), -1)): the empty share gets a zero-weight example.
    "padded_empty_share": dict(n=17, gbs=8, model="view", pad=True),
}


class _ViewFlatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1)  # fails on 0 examples: "-1 ... is ambiguous"



def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "view":
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), _ViewFlatten(), nn.Linear(64, 3))
    if kind == "bn":
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(strategy: towers.Strategy, *, n: int, gbs: int, model: str, epochs: int = 2, pad: bool = False) -> dict:
    """The user's custom loop, unchanged for every strategy; returns final state and per-step global losses."""
    with strategy.scope():
        net = _model(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net, optimizer = strategy.prepare(net, optimizer)
    batches = strategy.distribute_dataset(_data(n), gbs, shuffle=True, seed=3, pad_empty_batches=pad)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none"))
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses, shares = [], []
    for _ in range(epochs):
        for x, y in batches:
            shares.append(len(x))
            losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y))))
    # A sharded strategy's state holds this rank's shards (DTensors): compare the full tensors.
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in strategy.unwrap(net).state_dict().items()}
    return {"state": state, "losses": torch.stack(losses), "shares": shares}


#: Every synchronous multi-process strategy of the table, built with the options that make it synchronous.
SAME_MATHS = [e for e in roles.STRATEGIES if e.multi_process and e.same_maths_options is not None]


def _accepts(entry: roles.StrategyEntry, options: dict) -> bool:
    module, _, attr = entry.target.partition(":")
    parameters = inspect.signature(getattr(importlib.import_module(module), attr)).parameters
    return all(name in parameters for name in options)


def _replica(name: str, case_names: list[str], bitwise: bool = False) -> dict | None:
    entry = roles.strategy_entry(name)
    results = {}
    for case_name in case_names:
        case = CASES[case_name]
        extra = {"exit_on_ps": False} if entry.has_ps else {}  # a ps task returns here instead of exiting
        extra.update({"timeout_s": 60} if _accepts(entry, {"timeout_s": 60}) else {"peer_timeout_s": 10})
        extra.update(BITWISE if bitwise else {})
        strategy = towers.get_strategy(name, **entry.same_maths_options, **case.get("options", {}), **extra)
        if getattr(strategy, "is_ps", False):
            continue
        results[case_name] = train(strategy, n=case["n"], gbs=case["gbs"], model=case["model"],
                                   pad=case.get("pad", False))
        results[case_name]["replicas"] = strategy.num_replicas_in_sync
        # Each case leaves the job and the next joins it again, as a notebook building strategy after strategy does
        # (a later group must not read the earlier one's addresses); ps tasks are released, a quorum left.
        strategy.shutdown()
    return results or None


def _reference(name: str, bitwise: bool = False) -> dict:
    case = CASES[name]
    if bitwise:  # one process with the same micro-batches (and accumulation): the bits every replica count must give
        strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo(), **BITWISE, **case.get("options", {}))
        return train(strategy, n=case["n"], gbs=case["gbs"], model=case["model"], pad=case.get("pad", False))
    strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    return train(strategy, n=case["n"], gbs=case.get("ref_gbs", case["gbs"]), model=case["model"],
                 pad=case.get("pad", False))


def _references(names: list[str]) -> dict:
    return {name: _reference(name, bitwise=True) for name in names}


#: The bit-for-bit variant's options: micro-batches of 2 (the ragged batches cut into 2s and a 1).
BITWISE = {"bitwise": True, "micro_batch_size": 2}
#: The strategies that train bit for bit, with the replica counts their variant runs at.
BITWISE_RUNS = [("mirrored", 3), ("sharded", 2), ("fault_tolerant", 2), ("ps", 3), ("hybrid", 2)]


@pytest.mark.parametrize("name,replicas", BITWISE_RUNS)
def test_bitwise_strategies_give_one_process_bits_in_every_case(name, replicas):
    """The same cases under ``bitwise=True`` (SyncBatchNorm is refused there): every parameter and loss
    ``torch.equal`` to one process's with the same micro-batches, through ragged, one-example and padded last batches
    (empty shares) and gradient accumulation."""
    entry = roles.strategy_entry(name)
    names = [n for n in CASES if "sync_batchnorm" not in n and _accepts(entry, CASES[n].get("options", {}))]
    env, lighthouse = ({"TOWERS_STRATEGY": entry.name, "TOWERS_NUM_PS": "1"} if entry.has_ps else {}), None
    if entry.restarts_lost_replica:  # fault tolerant: a lighthouse, as towers launch runs one
        from towers.strategies.fault_tolerant import start_lighthouse

        lighthouse = start_lighthouse(peer_timeout_s=1)
        env.update(TORCHFT_LIGHTHOUSE=lighthouse.address, RUST_LOG="warn")
    try:  # one intra-op thread in every process, the reference's too: a CPU kernel may split its sums by thread
        per_rank = towers.spawn(_replica, replicas + entry.has_ps, args=(name, names, True), timeout_s=SPAWN_TIMEOUT_S,
                                threads_per_process=1, env=env)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    per_rank = [r for r in per_rank if r is not None]  # (a ps task returns nothing)
    refs = towers.spawn(_references, 1, args=(names,), timeout_s=SPAWN_TIMEOUT_S, threads_per_process=1)[0]
    for case_name in names:
        ref = refs[case_name]
        for rank, result in enumerate(per_rank):
            got = result[case_name]
            assert got["replicas"] == replicas and torch.equal(got["losses"], ref["losses"]), (case_name, rank)
            different = [k for k, v in ref["state"].items() if not torch.equal(got["state"][k], v)]
            assert different == [], (case_name, rank)


@pytest.mark.parametrize("name,replicas", [(e.name, 2) for e in SAME_MATHS] + [("mirrored", 3)])
def test_every_synchronous_strategy_matches_one_device(name, replicas):
    entry = roles.strategy_entry(name)
    names = [n for n in CASES if _accepts(entry, CASES[n].get("options", {}))]
    assert {"ragged_last_batch", "one_example_last_batch", "padded_empty_share"} <= set(names)
    env = {"TOWERS_STRATEGY": entry.name, "TOWERS_NUM_PS": "1"} if entry.has_ps else {}
    nprocs = replicas + (1 if entry.has_ps else 0)
    lighthouse = None
    if entry.restarts_lost_replica:  # fault tolerant: a lighthouse, as towers launch runs one
        from towers.strategies.fault_tolerant import start_lighthouse

        lighthouse = start_lighthouse(peer_timeout_s=1)
        env.update(TORCHFT_LIGHTHOUSE=lighthouse.address, RUST_LOG="warn")
    try:
        per_rank = towers.spawn(_replica, nprocs, args=(name, names), timeout_s=SPAWN_TIMEOUT_S, env=env)[:replicas]
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    for case_name in names:
        ref = _reference(case_name)
        micro = CASES[case_name].get("options", {}).get("gradient_accumulation_steps", 1)
        for rank, result in enumerate(per_rank):
            got = result[case_name]
            assert got["replicas"] == replicas
            losses = got["losses"]
            if micro > 1:  # a micro-batch's loss is its share of the update's mean: sum them per update
                losses = losses.reshape(-1, micro).sum(dim=1)
            assert torch.allclose(losses, ref["losses"], atol=ATOL), (case_name, rank, losses, ref["losses"])
            assert got["state"].keys() == ref["state"].keys()
            for key, value in ref["state"].items():
                assert torch.allclose(got["state"][key].double(), value.double(), atol=ATOL), (case_name, rank, key)
    # The data really was ragged: the last batch of "one_example_last_batch" left some replicas empty.
    last_shares = [r["one_example_last_batch"]["shares"][2] for r in per_rank]
    assert last_shares == [1] + [0] * (replicas - 1)
    assert [r["padded_empty_share"]["shares"][2] for r in per_rank] == [1] * replicas  # padding, weight zero
    assert sum(r["ragged_last_batch"]["shares"][2] for r in per_rank) == 6


def _strategies_one_after_another(out_dir: str) -> list[float]:
    """Three strategies in a row; after each, the chief writes a checkpoint-sized file before its shutdown, so the
    others finish theirs first and already join the next strategy's group through the chief's store."""
    import os

    sums = []
    for i in range(3):
        strategy = towers.MirroredStrategy()
        sums.append(strategy.reduce("sum", torch.ones(1)).item())
        if strategy.is_chief:
            torch.save({"weights": torch.randn(16_000_000)}, os.path.join(out_dir, f"checkpoint{i}.pt"))
        strategy.shutdown()
    return sums


def test_a_strategy_built_while_the_chief_still_shuts_the_last_one_down_joins(tmp_path):
    """The chief's store server outlives its group: a peer that joined the next group through it before the chief's
    shutdown lost its connection mid-join ('Failed to recv, got 0 bytes') when the server stopped with the group."""
    assert towers.spawn(_strategies_one_after_another, 3, args=(str(tmp_path),), timeout_s=120) == [[3.0] * 3] * 3
