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

Each start of a process costs more than all it does here, so the matrix runs in as few processes as
its order allows (readers after every writer): one_device in this process, and a job's processes
serve several writers or readers in turn, each under a strategy of its own (see ``matrix``).
"""

from __future__ import annotations

import os
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
    os.environ["TOWERS_STRATEGY"] = kind  # ps / hybrid, with TOWERS_NUM_PS from the job
    return towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)


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


def _write(strategy, out_dir: str, kind: str, rows: bool) -> dict:
    """Take SAVE_AT steps, save, go on to the end of the epoch; return the uninterrupted run's end."""
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
    return result


def _read(strategy, out_dir: str, sources: list[str]) -> dict:
    """Restore each source into a fresh model and optimizer and train to the end of the epoch."""
    results = {}
    for source in sources:
        model, optimizer, batches = _build(strategy, source.endswith("-rows"))
        try:
            state = restore_checkpoint(Path(out_dir) / source, {"model": model, "optimizer": optimizer,
                                                                "data": batches}, strategy=strategy)
        except CheckpointError as exc:
            results[source] = {"error": str(exc)}
            continue
        later: list[int] = []
        _train(strategy, model, optimizer, batches, None, later)
        results[source] = {**_final(strategy, model, optimizer), "later": later, "step": state["step"]}
    return results


#: A part of a job: under a new strategy of this kind, write a checkpoint of each model (True: the one
#: with ps rows), then restore each source into a fresh model.
Part = tuple[str, tuple[bool, ...], tuple[str, ...]]


def _job(out_dir: str, parts: list[Part]) -> list[dict | None]:
    """One job whose processes run each part in turn, each part under a strategy of its own.

    A part after the first finds the job's process group still there (ps and hybrid keep it at
    shutdown) and makes its own strategy on it, a ps strategy with its own links to its ps tasks,
    which serve a part until its workers are done. A ps strategy takes one model, so the dense and
    the rows model are two parts. Returns each part's results (None on a ps task).
    """
    results: list[dict | None] = []
    for kind, write, read in parts:
        strategy = _strategy(kind)
        if getattr(strategy, "is_ps", False):
            results.append(None)  # the ps task served this part until the workers were done
            continue
        results.append({"written": {rows: _write(strategy, out_dir, kind, rows) for rows in write},
                        "read": _read(strategy, out_dir, list(read))})
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


WRITERS = ["one_device", "mirrored", "sharded", "hsdp", "ps", "hybrid"]  # processes: 1, 2, 2, 4, 3, 3 (see matrix)
READERS = {"one_device": 1, "mirrored": 2, "sharded": 3, "ps": 2}  # replicas or workers (ps: + 2 ps tasks)
DENSE = [f"{kind}-dense" for kind in WRITERS]
ROWS = ["ps-rows", "hybrid-rows"]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """Every writer's and reader's results, from as few processes as the order of the matrix allows.

    Readers come after every writer. one_device writes and reads in this process; ps and hybrid
    write both models in one job of 3; mirrored writes last and then reads every checkpoint in the
    same job; the readers of 3 (sharded) and 4 (ps, dense then rows) come last, and the one_device
    reader is refused the rows. (Strategies that leave the process group at shutdown, Mirrored and
    FullySharded, each get a job of their own: a second one joining a group again in the same
    processes can hang.)
    """
    out = str(tmp_path_factory.mktemp("checkpoints"))
    reference = _one_device_reference()
    written: dict[str, dict[bool, dict]] = {}
    read: dict[str, list[dict]] = {}

    def job(n: int, parts: list[Part], env: dict | None = None) -> None:
        ranks = ([_job(out, parts)] if n == 1 else  # no job to launch: this process
                 towers.spawn(_job, n, args=(out, parts), timeout_s=150, env=env))
        for i, (kind, write, sources) in enumerate(parts):
            workers = [r[i] for r in ranks if r[i] is not None]  # ps tasks left out
            for rows in write:
                written.setdefault(kind, {})[rows] = workers[0]["written"][rows]
            if sources:  # one result per worker/replica
                for mine, worker in zip(read.setdefault(kind, [{} for _ in workers]), workers, strict=True):
                    mine.update(worker["read"])

    job(1, [("one_device", (False,), ())])
    job(4, [("hsdp", (False,), ())])
    job(3, [(kind, (rows,), ()) for kind in ("ps", "hybrid") for rows in (False, True)], {"TOWERS_NUM_PS": "1"})
    job(2, [("sharded", (False,), ())])
    job(2, [("mirrored", (False,), tuple(DENSE))])  # the last writer, and the mirrored reader
    job(1, [("one_device", (), tuple(DENSE + ROWS))])
    job(3, [("sharded", (), tuple(DENSE))])
    job(4, [("ps", (), tuple(DENSE)), ("ps", (), tuple(ROWS))], {"TOWERS_NUM_PS": "2"})
    assert set(written) == set(WRITERS) and set(read) == set(READERS)
    return {"out": Path(out), "reference": reference, "written": written, "read": read}


def test_dense_state_carries_across_strategies_and_sizes(matrix):
    reference, out = matrix["reference"], matrix["out"]
    for kind in WRITERS:
        _close(matrix["written"][kind][False], reference, f"{kind} uninterrupted")
        plain = Dense()  # the user's own module, no towers
        plain.load_state_dict(load_file(str(out / f"{kind}.safetensors")))
        for key, value in plain.state_dict().items():
            assert torch.allclose(value, reference["params"][key], atol=ATOL), (kind, "export", key)
    for kind, n in READERS.items():
        results = matrix["read"][kind]
        assert len(results) == n  # every worker/replica ends where one device does
        for rank, result in enumerate(results):
            for source in DENSE:
                got = result[source]
                assert "error" not in got, (kind, source, got)
                assert got["step"] == SAVE_AT
                _close(got, reference, f"{source} -> {kind} rank {rank}")
        assert results[0][DENSE[0]]["later"]  # the data went on
        if kind == "one_device":  # the data continued at the next example: the same batches as uninterrupted
            assert all(results[0][s]["later"] == reference["later"] for s in DENSE)


def test_embedding_rows_carry_to_another_number_of_ps_tasks_and_are_refused_without_ps(matrix):
    assert len(matrix["read"]["ps"]) == READERS["ps"]
    for rank, result in enumerate(matrix["read"]["ps"]):
        for source, kind in zip(ROWS, ("ps", "hybrid")):
            got = result[source]
            assert "error" not in got, got
            assert any(k.startswith("table.rows.slot") for k in got["params"])  # the rows' Adagrad state came along
            _close(got, matrix["written"][kind][True], f"{source} -> ps with 2 ps tasks, rank {rank}")
    refused = matrix["read"]["one_device"][0]
    for source, kind in zip(ROWS, ("ps", "hybrid")):
        text = refused[source]["error"]
        assert f"written under strategy {kind!r}" in text and "this job runs 'one_device'" in text
        assert "table.rows" in text and "restore it under a strategy with ps tasks" in text
