"""Habits x strategies: every habit a torch user brings, under every strategy, against the plain one-device loop.

Habits (``tests/habit_matrix_job.py``, all in sequence in ONE job per strategy): torch's own
``clip_grad_norm_``; manual accumulation (two batches per update, ``loss / 2``, DDP's ``no_sync()`` on the
first where the model has it), and the same in a plain loop (no ``strategy.run``) without ``no_sync()``; an
EMA through torch's ``AveragedModel`` (and through towers' ``ExponentialMovingAverage``, the way that also
works sharded and pipelined); ``torch.compile`` of the prepared model; an LR scheduler stepped per batch;
two models with two optimizers (DCGAN's loop); evaluation between steps (``model.eval()``, ``no_grad``,
``model.train()``); bf16 autocast; ``copy.deepcopy`` and ``torch.save`` of the model.

Strategies: one process (``python job.py``), and under ``towers launch``: Mirrored 2, sharded 2, ps sync
(2 workers + 1 ps), hybrid (2 workers + 1 ps), ``--mesh tp=2``, ``--mesh pp=2`` and fault tolerant (2 replica
groups; one job per habit, since it trains only the models prepared before its first step).

The reference of every cell is the loop a user writes on one device without towers, computed here. A cell
either equals it (``RTOL``/``ATOL``; bf16 autocast within ``BF16_TOL``: its matmuls round per batch shape,
and a replica's batch is a share of the global one) or is a refusal listed in ``REFUSED`` whose text names
the supported way. Anything else (a wrong result, an unexpected error, an expected refusal that did not
come) fails the strategy's test, which lists every such cell of its row at once.
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cli_support import run, towers_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import habit_matrix_job as job  # noqa: E402

pytestmark = pytest.mark.timeout(400)

SCRIPT = Path(job.__file__).resolve()
DEADLINE_S = 240
RTOL, ATOL = 1e-5, 1e-6
BF16_TOL = 3e-2

#: strategy -> towers launch arguments (None: ``python job.py``, one process).
STRATEGIES: dict[str, list[str] | None] = {
    "one process": None,
    "mirrored 2": ["--nproc-per-node", "2", "--strategy", "mirrored"],
    "sharded 2": ["--nproc-per-node", "2", "--strategy", "sharded"],
    "ps sync": ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=sync"],
    "hybrid": ["--nproc-per-node", "3", "--strategy", "hybrid", "--num-ps", "1", "--strategy-option", "mode=sync"],
    "tp=2": ["--nproc-per-node", "2", "--strategy", "sharded", "--mesh", "tp=2"],
    "pp=2": ["--nproc-per-node", "2", "--strategy", "sharded", "--mesh", "pp=2"],
    "fault tolerant": ["--nproc-per-node", "2", "--strategy", "fault_tolerant", "--group-restarts", "0"],
}
#: Strategies that train the models prepared before their first step only (a replica group started again heals those):
#: one job per habit there, each a few seconds.
ONE_JOB_PER_HABIT = ("fault tolerant",)
#: The replicas of each strategy's job (a tp or pp mesh of 2 processes holds one model replica).
REPLICAS = {"one process": 1, "tp=2": 1, "pp=2": 1}

#: (strategy, habit) -> words the refusal must contain (the supported way). Every other cell trains as one device.
REFUSED: dict[tuple[str, str], tuple[str, ...]] = {
    ("ps sync", "clip"): ("clip_grad_norm_", "SHARE"),
    ("ps sync", "gan"): ("one model at a time", "HybridStrategy"),
    ("pp=2", "clip"): ("strategy.clip_grad_norm_", "stage"),
    ("pp=2", "gan"): ("strategy.forward_backward",),
    ("pp=2", "compile"): ("torch.compile", "without pp"),
    ("fault tolerant", "accumulation"): ("optimizer.step() once per batch", "gradient_accumulation_steps"),
    ("fault tolerant", "accumulation_loop"): ("optimizer.step() once per batch", "gradient_accumulation_steps"),
    **{(s, "accumulation_loop"): ("outside strategy.run", "inside the step function") for s in ("ps sync", "hybrid")},
    ("fault tolerant", "gan"): ("one optimizer step per batch", "HybridStrategy"),
    # copy.deepcopy (AveragedModel's first step) of a model whose parameters are shards or one stage
    **{(s, h): ("strategy.full_state_dict", "towers.ExponentialMovingAverage") for s in ("sharded 2", "tp=2", "pp=2")
       for h in ("ema", "copy")},
}


# --- the plain loops: one device, no towers ---------------------------------------------------------------------
def _batches(size: int = job.GB) -> list[tuple[torch.Tensor, ...]]:
    x, y, z = job.data()
    return [(x[i:i + size], y[i:i + size], z[i:i + size]) for i in range(0, job.ROWS, size)]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, after_step=lambda: None,
           around=contextlib.nullcontext) -> None:
    for xb, yb, _ in _batches():
        with around():
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after_step()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plain(habit: str) -> dict[str, Any]:
    model = job.classifier()
    optimizer = job.sgd(model)
    out: dict[str, Any] = {}
    if habit == "clip":
        out["norms"] = []
        for xb, yb, _ in _batches():
            F.cross_entropy(model(xb), yb).backward()
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.CLIP)))
            optimizer.step()
            optimizer.zero_grad()
    elif habit in ("accumulation", "accumulation_loop"):
        for i, (xb, yb, _) in enumerate(_batches(job.GB // 2)):
            (F.cross_entropy(model(xb), yb) / 2).backward()
            if i % 2:
                optimizer.step()
                optimizer.zero_grad()
    elif habit in ("ema", "ema_helper"):  # the plain loop's EMA is torch's AveragedModel
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(job.EMA_DECAY))
        _train(model, optimizer, after_step=lambda: average.update_parameters(model))
        out["ema"] = _weights(average.module)
    elif habit == "scheduler":
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        out["rates"] = []
        _train(model, optimizer, after_step=lambda: (schedule.step(), out["rates"].append(schedule.get_last_lr()[0])))
    elif habit == "gan":
        gen, disc = job.generator(), job.classifier(outputs=1, seed=2)
        opt_g, opt_d = job.sgd(gen), job.sgd(disc)
        for xb, _, zb in _batches():
            fake = gen(zb)
            opt_d.zero_grad()
            (F.binary_cross_entropy_with_logits(disc(xb).squeeze(1), torch.ones(len(xb)))
             + F.binary_cross_entropy_with_logits(disc(fake.detach()).squeeze(1), torch.zeros(len(zb)))).backward()
            opt_d.step()
            opt_g.zero_grad()
            F.binary_cross_entropy_with_logits(disc(fake).squeeze(1), torch.ones(len(zb))).backward()
            opt_g.step()
        return {"generator": _weights(gen), "discriminator": _weights(disc)}
    elif habit == "eval":
        xv, yv = job.validation()
        out["losses"] = []

        def evaluate() -> None:
            model.eval()
            with torch.no_grad():
                out["losses"].append(float(F.cross_entropy(model(xv), yv)))
            model.train()

        _train(model, optimizer, after_step=evaluate)
    elif habit == "bf16":
        _train(model, optimizer, around=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    elif habit == "copy":
        _train(model, optimizer)
        with torch.no_grad():
            out["copy outputs"] = copy.deepcopy(model)(job.validation()[0])
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        out["saved"] = torch.load(buffer, weights_only=True)
    else:  # compile: the plain loop compiles nothing (the maths is the same)
        _train(model, optimizer)
    out["weights"] = _weights(model)
    return out


# --- the comparison -----------------------------------------------------------------------------------------------
def _differences(got: Any, want: Any, tol: tuple[float, float], where: str) -> list[str]:
    if got is None and not where.startswith("rank 0:") and isinstance(want, dict):
        return []  # the whole weights gathered onto the chief only (FSDP2's full state dict)
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(got) != sorted(want):
            return [f"{where}: keys {sorted(got) if isinstance(got, dict) else type(got).__name__} != {sorted(want)}"]
        return [d for k in want for d in _differences(got[k], want[k], tol, f"{where}/{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got!r} != {want!r}"]
        return [d for i, (a, b) in enumerate(zip(got, want)) for d in _differences(a, b, tol, f"{where}[{i}]")]
    a, b = torch.as_tensor(got, dtype=torch.float32), torch.as_tensor(want, dtype=torch.float32)
    if a.shape != b.shape or not torch.allclose(a, b, rtol=tol[0], atol=tol[1]):
        worst = float((a - b).abs().max()) if a.shape == b.shape else float("nan")
        return [f"{where}: off by {worst:.3g} (rtol {tol[0]}, atol {tol[1]})"]
    return []


def _cell_problems(strategy: str, habit: str, ranks: list[dict], want: dict) -> list[str]:
    refusal = REFUSED.get((strategy, habit))
    problems = []
    for rank, results in enumerate(ranks):
        got = results[habit]
        if refusal is not None:
            if not (isinstance(got, str) and all(word in got for word in refusal)):
                problems.append(f"{habit}, rank {rank}: expected a refusal naming {refusal}, got {str(got)[:300]}")
            continue
        if isinstance(got, str):
            problems.append(f"{habit}, rank {rank}: {got[:600]}")
            continue
        tol = (BF16_TOL, BF16_TOL) if habit == "bf16" else (RTOL, ATOL)
        problems += _differences(got, want, tol, f"rank {rank}: {habit}")
    return problems


@pytest.fixture(scope="module")
def plain() -> dict[str, dict]:
    return {habit: _plain(habit) for habit in job.HABITS}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_habit_trains_as_one_device_or_is_refused_by_name(tmp_path: Path, strategy: str, plain: dict) -> None:
    launch = STRATEGIES[strategy]
    command = [sys.executable, str(SCRIPT)] if launch is None else [*towers_command(), "launch", *launch, str(SCRIPT)]
    jobs = [(h, [h]) for h in job.HABITS] if strategy in ONE_JOB_PER_HABIT else [("habits", [])]
    ranks: list[dict] = []
    for name, habits in jobs:
        done = run([*command, str(tmp_path / name), *([",".join(habits)] if habits else [])], cwd=tmp_path,
                   deadline_s=DEADLINE_S, marker=str(tmp_path))
        assert done.returncode == 0, f"{strategy}, {name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        for i, f in enumerate(sorted(tmp_path.glob(f"{name}.rank*.pt"))):
            if len(ranks) <= i:
                ranks.append({})
            ranks[i].update(torch.load(f, weights_only=True))
    workers = [r for r in ranks if "clip" in r]  # ps tasks serve; they run no habit
    assert workers and all(r["replicas"] == REPLICAS.get(strategy, 2) for r in workers), [r["replicas"] for r in workers]
    problems = [p for habit in job.HABITS for p in _cell_problems(strategy, habit, workers, plain[habit])]
    assert not problems, f"{strategy}: {len(problems)} cell problem(s):\n" + "\n".join(problems)
