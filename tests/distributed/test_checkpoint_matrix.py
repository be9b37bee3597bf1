"""One checkpoint, any strategy: saved under one strategy and size, restored under another, training goes on exactly.

Writers take 2 steps of an epoch of 4 global batches (Adam), save ``{"model", "optimizer", "data",
"step"}`` with ``towers.checkpoint.save_checkpoint`` and go on to the end of the epoch (what an
uninterrupted run does: saving changes nothing). Readers build a fresh model and optimizer,
restore each writer's checkpoint and take the remaining 2 steps: parameters AND Adam's moments
must equal one device's uninterrupted run, and the data must continue at the next example.

Writers: one_device (1), mirrored (2), sharded (2), sharded HSDP (4 = 2 x 2), ps sync (2 workers + 1
ps), hybrid (2 workers + 1 ps); each also exports its model for inference, which loads into the plain
module without towers. Readers: one_device (1), mirrored (2), sharded (3), ps sync with 2
ps tasks (2 workers + 2 ps). A model with parameter-server embedding rows goes from ps (1 ps task)
and hybrid to ps with 2 ps tasks (rows and their Adagrad slots), and is refused, naming both
strategies, under a strategy without ps tasks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import towers
from towers.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from towers.cluster.info import ProcessInfo

pytestmark = pytest.mark.timeout(300)

GBS, SAVE_AT, ATOL = 8, 2, 1e-5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(4 * GBS, 6, generator=g), torch.randint(0, 3, (4 * GBS,), generator=g)


def _emb_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 30, (4 * GBS, 3), generator=g)
    return ids, (ids.sum(1) % 3)


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WithRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = towers.ShardedEmbedding(40, 4, mode="mean", optimizer="adagrad", lr=0.3, seed=2)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


def _strategy(kind: str) -> towers.Strategy:
    if kind == "one_device":
        return towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    if kind == "mirrored":
        return towers.MirroredStrategy(timeout_s=60)
    if kind == "sharded":
        return towers.FullyShardedStrategy(timeout_s=60, shard_units=nn.Linear)
    if kind == "hsdp":
        return towers.FullyShardedStrategy(timeout_s=60, shard_units=nn.Linear, shard_group_size=2)
    return towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)  # ps / hybrid: from TOWERS_*


def _build(strategy: towers.Strategy, rows: bool) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    with strategy.scope():
        model = WithRows() if rows else Dense()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(_emb_data() if rows else _data(), GBS, shuffle=True, seed=5)
    return model, optimizer, batches


def _train(strategy, model, optimizer, batches, steps: int | None, seen: list[int]) -> int:
    """Take ``steps`` steps (None: to the end of the epoch) from ``batches``, an iterator kept across calls."""
    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    done = 0
    for x, y in batches:
        seen.append(int(x.sum().round()) if x.dtype != torch.int64 else int(x.sum()))  # which examples came
        strategy.run(step, args=(x, y))
        done += 1
        if steps is not None and done == steps:
            break
    return done


def _final(strategy, model, optimizer) -> dict:
    """Full parameters and Adam moments by parameter name, wherever they live (shards, ps tasks)."""
    state = strategy.state_dict(model, optimizer)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    out = {"params": {}, "moments": {}}
    for k, v in state["model"].items():
        if isinstance(v, dict):  # embedding rows: ids, weight, slot_*
            out["params"].update({f"{k}.{f}": t.clone() for f, t in v.items()})
        else:
            out["params"][k] = full(v).detach().clone()
    for name, s in state["optimizer"]["state"].items():
        out["moments"][name] = full(s["exp_avg"]).clone()
    return out


def _writer(out_dir: str, kind: str, rows: bool) -> dict | None:
    strategy = _strategy(kind)
    if getattr(strategy, "is_ps", False):
        return None
    model, optimizer, batches = _build(strategy, rows)
    epoch = iter(batches)
    _train(strategy, model, optimizer, epoch, SAVE_AT, [])
    path = Path(out_dir) / f"{kind}-{'rows' if rows else 'dense'}"
    save_checkpoint(path, {"model": model, "optimizer": optimizer, "data": batches, "step": SAVE_AT}, strategy=strategy)
    later: list[int] = []
    _train(strategy, model, optimizer, epoch, None, later)  # the uninterrupted run goes on
    result = {**_final(strategy, model, optimizer), "later": later}
    if not rows:  # export for inference: the plain module's full weights, loaded below without towers
        strategy.export_model(model, Path(out_dir) / f"{kind}.safetensors")
    strategy.shutdown()
    return result


def _reader(out_dir: str, kind: str, sources: list[str], rows: bool) -> dict | None:
    strategy = _strategy(kind)
    if getattr(strategy, "is_ps", False):
        return None
    results = {}
    for source in sources:
        model, optimizer, batches = _build(strategy, rows)
        try:
            state = restore_checkpoint(Path(out_dir) / source, {"model": model, "optimizer": optimizer,
                                                                "data": batches}, strategy=strategy)
        except CheckpointError as exc:
            results[source] = {"error": str(exc)}
            continue
        later: list[int] = []
        _train(strategy, model, optimizer, batches, None, later)
        results[source] = {**_final(strategy, model, optimizer), "later": later, "step": state["step"]}
    strategy.shutdown()
    return results


def _one_device_reference() -> dict:
    strategy = _strategy("one_device")
    model, optimizer, batches = _build(strategy, rows=False)
    later: list[int] = []
    epoch = iter(batches)
    _train(strategy, model, optimizer, epoch, SAVE_AT, [])
    _train(strategy, model, optimizer, epoch, None, later)
    return {**_final(strategy, model, optimizer), "later": later}


def _close(got: dict, want: dict, what: str) -> None:
    for part in ("params", "moments"):
        assert set(got[part]) == set(want[part]), (what, part)
        for key, value in want[part].items():
            assert torch.allclose(got[part][key], value, atol=ATOL), (what, part, key)


WRITERS = [("one_device", 1, {}), ("mirrored", 2, {}), ("sharded", 2, {}), ("hsdp", 4, {}),
           ("ps", 3, {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"}),
           ("hybrid", 3, {"TOWERS_STRATEGY": "hybrid", "TOWERS_NUM_PS": "1"})]
READERS = [("one_device", 1, {}), ("mirrored", 2, {}), ("sharded", 3, {}),
           ("ps", 4, {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "2"})]


def test_dense_state_carries_across_strategies_and_sizes(tmp_path):
    reference = _one_device_reference()
    for kind, n, env in WRITERS:
        written = towers.spawn(_writer, n, args=(str(tmp_path), kind, False), timeout_s=120, env=env)
        _close(written[0], reference, f"{kind} uninterrupted")
        plain = Dense()  # the user's own module, no towers
        plain.load_state_dict(load_file(str(tmp_path / f"{kind}.safetensors")))
        for key, value in plain.state_dict().items():
            assert torch.allclose(value, reference["params"][key], atol=ATOL), (kind, "export", key)
    sources = [f"{kind}-dense" for kind, _, _ in WRITERS]
    for kind, n, env in READERS:
        results = towers.spawn(_reader, n, args=(str(tmp_path), kind, sources, False), timeout_s=150, env=env)
        for rank in range(n if kind != "ps" else 2):  # every worker/replica ends where one device does
            for source in sources:
                got = results[rank][source]
                assert "error" not in got, (kind, source, got)
                assert got["step"] == SAVE_AT
                _close(got, reference, f"{source} -> {kind} rank {rank}")
        assert results[0][sources[0]]["later"]  # the data went on
        if kind == "one_device":  # the data continued at the next example: the same batches as uninterrupted
            assert all(results[0][s]["later"] == reference["later"] for s in sources)


def test_embedding_rows_carry_to_another_number_of_ps_tasks_and_are_refused_without_ps(tmp_path):
    written = {}
    for kind, n, env in WRITERS[4:]:
        written[kind] = towers.spawn(_writer, n, args=(str(tmp_path), kind, True), timeout_s=120, env=env)[0]
    sources = ["ps-rows", "hybrid-rows"]
    results = towers.spawn(_reader, 4, args=(str(tmp_path), "ps", sources, True), timeout_s=150, env=READERS[3][2])
    for rank in (0, 1):
        for source, kind in zip(sources, ("ps", "hybrid")):
            got = results[rank][source]
            assert "error" not in got, got
            assert any(k.startswith("table.rows.slot") for k in got["params"])  # the rows' Adagrad state came along
            _close(got, written[kind], f"{source} -> ps with 2 ps tasks, rank {rank}")
    refused = towers.spawn(_reader, 1, args=(str(tmp_path), "one_device", sources, True), timeout_s=60)[0]
    for source, kind in zip(sources, ("ps", "hybrid")):
        text = refused[source]["error"]
        assert f"written under strategy {kind!r}" in text and "this job runs 'one_device'" in text
        assert "table.rows" in text and "restore it under a strategy with ps tasks" in text
