"""Run the scaling benchmark: one spawned job per replica count, towers and raw DDP interleaved inside it.

Within a job every engine shares the same processes and process group; repeats alternate the
order of the engines (raw first, then towers first, ...) so slow drift on a shared machine
(thermal, other tenants) hits both alike. Rank 0 reports global examples/s per repeat.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, Sequence

from towers._logging import get_logger, set_rank
from towers.bench.config import BenchConfig, available_cores
from towers.bench.report import RAW, BenchReport, Measurement
from towers.bench.workloads import RawTorchWorkload, TowersWorkload, Workload

__all__ = ["run_benchmark", "measure_interleaved"]

log = get_logger(__name__)

def run_benchmark(config: BenchConfig, *, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every strategy and raw DDP at every replica count in ``config`` and return the report.

    ``progress`` (default: the library logger) receives one line per job started.

    Raises:
        towers.launch.SpawnError: when a job fails or passes its deadline (the message shows every rank).
    """
    from towers.launch import spawn

    say = progress or log.info
    cores = available_cores()
    measurements: list[Measurement] = []
    notes: list[str] = []
    for n in config.replicas:
        if n * config.threads > cores:
            note = (f"note: {n} replicas x {config.threads} thread(s) oversubscribe this machine's {cores} cores; "
                    f"numbers at {n} replicas measure contention, not scaling.")
            log.warning(note)
            notes.append(note)
    mirrored = [s for s in config.strategies if s == "mirrored"]
    for s in config.strategies:
        if s.startswith("ps_"):
            note = f"note: {s} skipped: ParameterServerStrategy is not available in this build of towers yet."
            log.warning(note)
            notes.append(note)
    for n in config.replicas:
        engines = 1 + len(mirrored)
        timeout_s = config.job_timeout_s(n, engines, cores)
        say(f"measuring {n} replica(s): raw DDP{' and ' + ', '.join(mirrored) if mirrored else ''}, "
            f"{config.repeats} repeats x {config.steps} steps (deadline {timeout_s:.0f} s)")
        results = spawn(_mirrored_job, n, args=(config, n, tuple(mirrored)), timeout_s=timeout_s,
                        threads_per_process=config.threads)
        report = results[0]
        for name, (engine, values) in report["measured"].items():
            measurements.append(Measurement(name, n, engine, tuple(values)))
        for name, reason in report["skipped"].items():
            note = f"note: {name} at {n} replica(s) skipped: {reason}"
            log.warning(note)
            notes.append(note)
    return BenchReport(measurements=measurements, config=asdict(config), environment=_environment(cores),
                       notes=notes)


def _environment(cores: int) -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cores": cores, "machine": platform.machine()}


def _make_strategy(name: str, num_replicas: int) -> Any:
    """Return the towers strategy a user would pick for ``name`` at ``num_replicas``."""
    import towers

    if name == "mirrored" and num_replicas == 1:
        return towers.OneDeviceStrategy("cpu")  # what strategy_from_env picks for one process
    return towers.get_strategy(name)


def _mirrored_job(config: BenchConfig, num_replicas: int, strategies: Sequence[str]) -> dict[str, Any]:
    """Body of one spawned rank: build raw DDP and towers workloads on one process group, measure them interleaved."""
    import torch.distributed as dist

    if num_replicas > 1:
        # The hand-written DDP script's own set-up: env:// reads the torchrun variables spawn() set.
        timeout_s = config.job_timeout_s(num_replicas, 1 + len(strategies))
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        rank, world_size, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier
    else:
        rank, world_size, barrier = 0, 1, _no_barrier
    set_rank(rank, world_size)
    spec = config.workload_spec()
    workloads: dict[str, Workload] = {RAW: RawTorchWorkload(spec, rank=rank, world_size=world_size)}
    skipped: dict[str, str] = {}
    for name in strategies:
        try:
            workloads[name] = TowersWorkload(spec, _make_strategy(name, num_replicas))
        except NotImplementedError as exc:  # a strategy still being written: every rank skips it alike
            skipped[name] = str(exc)
    try:
        measured = measure_interleaved(workloads, config=config, num_replicas=num_replicas, barrier=barrier)
    finally:
        for w in workloads.values():
            w.close()
    return {"measured": {name: (workloads[name].engine, values) for name, values in measured.items()},
            "skipped": skipped}


def _no_barrier() -> None:
    return None


def measure_interleaved(workloads: dict[str, Workload], *, config: BenchConfig, num_replicas: int,
                        barrier: Callable[[], Any]) -> dict[str, list[float]]:
    """Return global examples/s per repeat for each workload, alternating their order every repeat.

    Each measurement: fresh pass, ``warmup`` untimed steps, barrier, ``steps`` timed steps, barrier.
    """
    names = list(workloads)
    measured: dict[str, list[float]] = {name: [] for name in names}
    examples = config.steps * config.batch_size * num_replicas
    for r in range(config.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            workload = workloads[name]
            workload.start_epoch()
            workload.train(config.warmup)
            barrier()
            start = time.perf_counter()
            workload.train(config.steps)
            barrier()
            measured[name].append(examples / (time.perf_counter() - start))
        line = ", ".join(f"{name} {measured[name][-1]:,.0f}" for name in names)
        log.info("%d replica(s), repeat %d/%d: examples/s %s", num_replicas, r + 1, config.repeats, line)
    return measured
