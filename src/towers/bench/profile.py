"""Where a step's time goes: per-phase timings of raw DDP and towers steps, side by side, on the same processes.

Phases (CPU work is synchronous, so timers around each call measure it): ``data`` (next
batch), ``forward``, ``loss``, ``backward`` (DDP's all-reduce overlaps it), ``optimizer``
(step + zero_grad), and for towers ``run`` (what ``strategy.run`` adds around the step
function). Each is timed in wall time and in this thread's CPU time. An op-level
``torch.profiler`` table of each engine is also returned.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from towers._logging import get_logger, set_rank
from towers.bench.config import BenchConfig
from towers.bench.runner import make_strategy
from towers.bench.workloads import RawTorchWorkload, TowersWorkload, Workload

__all__ = ["PHASES", "time_phases", "profile_job", "format_phases"]

log = get_logger(__name__)

PHASES = ("data", "run", "forward", "loss", "backward", "optimizer")


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _add(t: dict[str, list[float]], phase: str, a: tuple[float, float], b: tuple[float, float]) -> None:
    t[phase][0] += b[0] - a[0]
    t[phase][1] += b[1] - a[1]


def _raw_step(w: RawTorchWorkload, t: dict[str, list[float]]) -> None:
    a = _clock()
    x, y = w.next_batch()
    b = _clock()
    out = w.model(x)
    d = _clock()
    loss = F.cross_entropy(out, y)
    e = _clock()
    loss.backward()
    f = _clock()
    w.optimizer.step()
    w.optimizer.zero_grad(set_to_none=True)
    g = _clock()
    for phase, start, stop in (("data", a, b), ("forward", b, d), ("loss", d, e), ("backward", e, f),
                               ("optimizer", f, g)):
        _add(t, phase, start, stop)


def _towers_step(w: TowersWorkload, t: dict[str, list[float]]) -> None:
    marks: dict[str, tuple[float, float]] = {}

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        marks["b"] = _clock()
        out = w.model(x)
        marks["d"] = _clock()
        loss = w.compute_average_loss(F.cross_entropy(out, y, reduction="none"))
        marks["e"] = _clock()
        loss.backward()
        marks["f"] = _clock()
        w.optimizer.step()
        w.optimizer.zero_grad(set_to_none=True)
        marks["g"] = _clock()
        return loss

    a = _clock()
    x, y = w.next_batch()
    b = _clock()
    w.strategy.run(step, args=(x, y))
    h = _clock()
    m = marks
    for phase, start, stop in (("data", a, b), ("run", b, m["b"]), ("forward", m["b"], m["d"]), ("loss", m["d"], m["e"]),
                               ("backward", m["e"], m["f"]), ("optimizer", m["f"], m["g"]), ("run", m["g"], h)):
        _add(t, phase, start, stop)


def time_phases(workload: Workload, steps: int) -> dict[str, dict[str, float]]:
    """Return mean milliseconds per step of each phase over ``steps`` steps: ``{"wall": {...}, "cpu": {...}}``.

    ``cpu`` is this thread's CPU time: unlike wall time it barely moves when other programs
    compete for the cores, and it leaves out waiting (e.g. for a peer's all-reduce).
    """
    t = {phase: [0.0, 0.0] for phase in PHASES}
    for _ in range(steps):
        if isinstance(workload, TowersWorkload):
            _towers_step(workload, t)
        else:
            _raw_step(workload, t)  # type: ignore[arg-type]
    return {clock: {phase: 1000.0 * v[i] / steps for phase, v in t.items()} for i, clock in enumerate(("wall", "cpu"))}


def _op_table(workload: Workload, steps: int, row_limit: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        workload.train(steps)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


def profile_job(config: BenchConfig, num_replicas: int) -> dict[str, Any]:
    """Body of one spawned rank: per-phase ms/step, wall and CPU (medians over repeats), and op tables, raw vs towers."""
    import torch.distributed as dist

    rank, world_size, barrier = 0, 1, (lambda: None)
    if num_replicas > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=config.job_timeout_s(num_replicas, 2)))
        rank, world_size, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier
    set_rank(rank, world_size)
    spec = config.workload_spec()
    workloads: dict[str, Workload] = {"raw_ddp": RawTorchWorkload(spec, rank=rank, world_size=world_size),
                                      "mirrored": TowersWorkload(spec, make_strategy("mirrored", num_replicas))}
    phases: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in workloads}
    names = list(workloads)
    for r in range(config.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            w = workloads[name]
            w.start_epoch()
            w.train(config.warmup)
            barrier()
            phases[name].append(time_phases(w, config.steps))
            barrier()
        log.info("profile repeat %d/%d done", r + 1, config.repeats)
    tables = {}
    for name in names:
        w = workloads[name]
        w.start_epoch()
        w.train(config.warmup)
        barrier()
        tables[name] = _op_table(w, config.steps)
    medians = {clock: {name: {k: statistics.median(p[clock][k] for p in runs) for k in PHASES}
                       for name, runs in phases.items()} for clock in ("wall", "cpu")}
    for w in workloads.values():
        w.close()
    return {"rank": rank, "phases_ms": medians, "op_tables": tables}


def format_phases(phases_ms: dict[str, dict[str, float]], title: str = "") -> str:
    """Return an aligned table: one row per phase, ms/step for raw DDP and towers, and the difference."""
    lines = [title] if title else []
    lines.append(f"{'phase':<10} {'raw DDP ms':>11} {'towers ms':>10} {'towers-raw':>11}")
    raw, tow = phases_ms["raw_ddp"], phases_ms["mirrored"]
    for k in (*PHASES, "total"):
        a = sum(raw.values()) if k == "total" else raw[k]
        b = sum(tow.values()) if k == "total" else tow[k]
        lines.append(f"{k:<10} {a:>11.3f} {b:>10.3f} {b - a:>+11.3f}")
    return "\n".join(lines)
