"""Run the scaling benchmark: one spawned job per replica count and strategy, raw DDP interleaved beside it.

Within a job both engines share the same processes and process group and take turns every few
steps, so drift and other programs on a shared machine hit both alike. Rank 0 reports global
examples/s per repeat; every worker reports its CPU time per step.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Sequence

from towers._logging import configure_logging, configured_logging, get_logger, set_rank
from towers.bench.config import BenchConfig, available_cores, bench_strategy
from towers.bench.report import RAW, BenchReport, Measurement
from towers.bench.workloads import IdleWorkload, RawTorchWorkload, TowersWorkload, Workload, replica_device

__all__ = ["NUM_PS", "run_benchmark", "measure_interleaved", "make_strategy"]

log = get_logger(__name__)


def run_benchmark(config: BenchConfig, *, progress: Callable[[str], None] | None = None) -> BenchReport:
    """Measure every strategy, each beside raw DDP, at every replica count in ``config`` and return the report.

    One spawned job per (replica count, strategy). ``mirrored`` runs on N processes; when
    ``replicas`` includes 1, its 1-replica baselines (plain torch and ``OneDeviceStrategy``) run
    on rank 0 of each N-process job while the other ranks wait, interleaved with the N-replica
    runs, so a change in the machine's load between jobs cannot skew speed-up and efficiency.
    ``ps_async``/``ps_sync`` run on N workers plus one ps task (raw DDP on the workers' own
    subgroup); their 1-worker baseline is a job of its own. ``progress`` gets a line per job.

    Raises:
        towers.launch.SpawnError: when a job fails or passes its deadline (the message shows every rank).
    """
    from towers.launch import spawn

    say = progress or log.info
    cores = available_cores()
    # The jobs' processes print towers' lines the way this process does (the CLI's [rank r/w] output).
    log_level = logging.getLogger("towers").getEffectiveLevel() if configured_logging() else None
    measurements: list[Measurement] = []
    notes: list[str] = []
    devices: set[str] = set()  # where the replicas computed: cuda:<i> or cpu
    model_flops: dict[str, Any] = {}  # the workload's FLOPs per example and one device's peak (rank 0 of a job)
    multi = [n for n in config.replicas if n > 1]
    for strategy in sorted(config.strategies, key=lambda s: s != "mirrored"):
        num_ps = NUM_PS if bench_strategy(strategy)[1] else 0
        baseline = num_ps == 0 and 1 in config.replicas and bool(multi)
        for n in multi if baseline else config.replicas:
            procs = n + num_ps
            if procs * config.threads > cores:
                note = (f"note: {strategy} at {n} replica(s) runs {procs} process(es) x {config.threads} thread(s) on "
                        f"{cores} cores: oversubscribed, so its numbers include contention for the cores.")
                log.warning(note)
                notes.append(note)
            timeout_s = config.job_timeout_s(procs, 4 if baseline else 2, cores)
            say(f"measuring {strategy} beside raw DDP on {n} replica(s){f' + {num_ps} ps' if num_ps else ''}"
                f"{' (and both on 1 replica)' if baseline else ''}: {config.repeats} repeats x {config.steps} steps "
                f"(deadline {timeout_s:.0f} s)")
            results = spawn(_job, procs, args=(config, n, strategy, num_ps, baseline, log_level),
                            timeout_s=timeout_s, threads_per_process=config.threads)
            devices.update(r["device"] for r in results if r is not None and "device" in r)
            model_flops = model_flops or results[0].get("model_flops") or {}
            if results[0]["skipped"]:
                note = f"note: {strategy} at {n} replica(s) skipped: {results[0]['skipped']}"
                log.warning(note)
                notes.append(note)
            for m in _measurements(results, n, strategy):
                if not any(o.strategy == m.strategy and o.replicas == m.replicas for o in measurements):
                    measurements.append(m)  # one raw row per replica count: the first job's (mirrored's, if run)
    if any(bench_strategy(s)[1] for s in config.strategies):
        notes.append(f"note: *_async/*_sync run N workers + {NUM_PS} ps task; their CPU ms/step counts the workers only, "
                     "and raw DDP beside them runs on the workers' subgroup.")
    return BenchReport(measurements=measurements, config=asdict(config),
                       environment={**_environment(cores), "devices": sorted(devices)}, notes=notes,
                       model_flops=model_flops)


#: ps tasks a parameter-server benchmark job starts beside its workers.
NUM_PS = 1

#: Suffix of the 1-replica baselines measured inside an N-process job.
_AT_ONE = "@1"


def _environment(cores: int) -> dict[str, Any]:
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cores": cores, "machine": platform.machine()}


def make_strategy(name: str, num_replicas: int, *, timeout_s: float = 300.0, device: Any = "cpu") -> Any:
    """Return the towers strategy a user would pick for ``name`` at ``num_replicas`` (ps: one ps task)."""
    import towers

    base, options = bench_strategy(name)
    if options:  # a strategy with ps tasks, in one update mode
        return towers.get_strategy(base, num_ps=NUM_PS, timeout_s=timeout_s, exit_on_ps=False, **options)
    if num_replicas == 1:
        return towers.OneDeviceStrategy(str(device))  # what strategy_from_env picks for one process
    return towers.get_strategy(base, timeout_s=timeout_s)


def _job(config: BenchConfig, num_replicas: int, strategy: str, num_ps: int,
         baseline: bool = False, log_level: int | None = None) -> dict[str, Any] | None:
    """Body of one spawned rank: raw DDP and one towers strategy on the same processes, measured interleaved.

    With ``baseline``, rank 0 also runs both on 1 replica (the other ranks sit those turns out).
    Returns None on a ps task (it only serves), the rank's measurements on a worker.
    """
    import torch
    import torch.distributed as dist

    if log_level is not None and not configured_logging():
        configure_logging(log_level)
    world_size = num_replicas + num_ps
    timeout_s = config.job_timeout_s(world_size, 4)
    rank, group, barrier = 0, None, _no_barrier
    if world_size > 1:
        # The hand-written DDP script's own set-up: env:// reads the torchrun variables spawn() set.
        # NCCL between GPUs (one per replica); Gloo on CPUs and wherever ps tasks (which may have no GPU) take part.
        backend = "nccl" if replica_device(0, num_replicas).type == "cuda" and not num_ps else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        rank = dist.get_rank()
        if num_ps:  # raw DDP runs on the workers only; every rank takes part in creating the subgroup
            group = dist.new_group(list(range(num_replicas)))
        if num_replicas > 1:
            barrier = partial(dist.barrier, group=group)
    set_rank(rank, world_size)
    spec = config.workload_spec()
    # One host: the rank is the local rank. A ps task computes nothing here and keeps to the CPU.
    device = replica_device(rank, num_replicas) if rank < num_replicas else torch.device("cpu")
    if device.type == "cuda":
        # Kernels run asynchronously: a timed chunk must end when the GPU has finished it, not when it was queued.
        barrier = partial(_synchronized, barrier, device)
    skipped = ""
    try:  # the strategy computes where the raw baseline does (a ps task serves in here)
        made = make_strategy(strategy, num_replicas, timeout_s=timeout_s, device=device)
    except NotImplementedError as exc:  # a strategy still being written: every rank skips it alike
        made, skipped = None, str(exc)
    if rank >= num_replicas:
        return None
    workloads: dict[str, Workload] = {}
    if baseline:
        workloads[RAW + _AT_ONE] = RawTorchWorkload(spec, device=device) if rank == 0 else IdleWorkload()
        if made is not None:
            workloads[strategy + _AT_ONE] = TowersWorkload(spec, make_strategy(strategy, 1, device=device)) \
                if rank == 0 else IdleWorkload()
    workloads[RAW] = RawTorchWorkload(spec, rank=rank, world_size=num_replicas, process_group=group, device=device)
    if made is not None:
        workloads[strategy] = TowersWorkload(spec, made)
        if num_ps:
            workloads[strategy].engine = f"ParameterServerStrategy({made.mode}, {num_ps} ps)"
    try:
        measured = measure_interleaved(workloads, config=config, barrier=barrier)
    finally:
        for w in workloads.values():
            w.close()
    memory_mib = _peak_memory_mib(device)  # before the FLOP count below allocates its own model
    return {"measured": {name: (workloads[name].engine, values) for name, values in measured.items()},
            "skipped": skipped, "memory_mib": memory_mib, "device": str(device),
            "model_flops": _model_flops(spec, device) if rank == 0 else {}}


def _model_flops(spec: Any, device: Any) -> dict[str, Any]:
    """The workload's model FLOPs per example (one forward and backward, counted once) and one device's peak."""
    from towers.diagnostics.flops import batch_shape, count_flops
    from towers.diagnostics.peak import device_peak

    model = spec.make_model().to(device)
    x, y = (t[:spec.batch_size].to(device) for t in spec.make_raw_dataset(spec.batch_size).tensors)
    _, flops = count_flops(lambda: spec.loss_value(model(x), y).backward())
    shape = batch_shape((x, y))
    peak = device_peak(device)  # the benchmark's strategies compute in float32
    return {"flops_per_example": flops / shape.rows, "peak_flops": peak.flops_per_second if peak else None,
            "peak_label": peak.label if peak else None,
            "tokens_per_example": shape.tokens / shape.rows if shape.tokens else None}


def _synchronized(barrier: Callable[[], Any], device: Any) -> None:
    import torch

    torch.cuda.synchronize(device)
    barrier()


def _peak_memory_mib(device: Any) -> float:
    """Return this process's peak memory in MiB: GPU memory allocated by torch on a GPU, else resident memory."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _measurements(results: Sequence[dict[str, Any] | None], num_replicas: int, strategy: str) -> list[Measurement]:
    """Return the job's measurements from the workers' reports: rank 0's examples/s, CPU ms/step averaged.

    Each towers measurement carries the raw series of the same job (ratio denominators); each
    N-replica one, when baselines ran, the same engine's 1-replica series (speed-up denominators).
    """
    reports = [r for r in results if r is not None]
    measured = reports[0]["measured"]
    has_base = RAW + _AT_ONE in measured

    def combine(name: str, **paired: Any) -> Measurement:
        engine, values = measured[name]
        at_one = name.endswith(_AT_ONE)
        per_rank = [r["measured"][name][1]["cpu_ms_per_step"] for r in (reports[:1] if at_one else reports)]
        cpu = tuple(sum(v) / len(v) for v in zip(*per_rank))
        if has_base and not at_one:
            paired["base_examples_per_s"] = tuple(measured[name + _AT_ONE][1]["examples_per_s"])
        memory = max(r.get("memory_mib", 0.0) for r in (reports[:1] if at_one else reports))
        return Measurement(name.removesuffix(_AT_ONE), 1 if at_one else num_replicas, engine,
                           tuple(values["examples_per_s"]), cpu, memory_mib=memory or None, **paired)

    out = []
    for suffix in (_AT_ONE, "") if has_base else ("",):
        raw = combine(RAW + suffix)
        out.append(raw)
        if strategy + suffix in measured:
            out.append(combine(strategy + suffix, raw_examples_per_s=raw.examples_per_s,
                               raw_cpu_ms_per_step=raw.cpu_ms_per_step))
    return out


def _no_barrier() -> None:
    return None


def measure_interleaved(workloads: dict[str, Workload], *, config: BenchConfig,
                        barrier: Callable[[], Any]) -> dict[str, dict[str, list[float]]]:
    """Return, per workload, ``examples_per_s`` (global) and this process's ``cpu_ms_per_step``, one value per repeat.

    A repeat gives each workload a fresh pass and ``warmup`` untimed steps, then times its
    ``steps`` steps in chunks of ``interleave_steps``, the workloads taking turns chunk by chunk
    in A B B A order (the first workload alternates between repeats), so both share the
    machine's noise. Each chunk is timed from a barrier to a barrier, so it lasts until the
    slowest rank is done. CPU time (all threads of this process) is barely touched by other
    programs competing for the cores, so it shows per-step overhead when wall time is noisy.
    """
    names = list(workloads)
    measured: dict[str, dict[str, list[float]]] = {name: {"examples_per_s": [], "cpu_ms_per_step": []} for name in names}
    examples = {name: config.steps * config.batch_size * w.num_replicas for name, w in workloads.items()}
    chunk = config.interleave_steps or config.steps
    for r in range(config.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            workloads[name].start_epoch()
            workloads[name].train(config.warmup)
        wall, cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        done, turn = 0, 0
        while done < config.steps:
            steps = min(chunk, config.steps - done)
            for name in order if turn % 2 == 0 else order[::-1]:
                barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                workloads[name].train(steps)
                barrier()
                wall[name] += time.perf_counter() - start
                cpu[name] += time.process_time() - start_cpu
            done, turn = done + steps, turn + 1
        for name in names:
            measured[name]["examples_per_s"].append(examples[name] / wall[name])
            measured[name]["cpu_ms_per_step"].append(1000.0 * cpu[name] / config.steps)
        line = ", ".join(f"{name} {measured[name]['examples_per_s'][-1]:,.0f} "
                         f"({measured[name]['cpu_ms_per_step'][-1]:.1f} CPU ms/step)" for name in names)
        log.info("repeat %d/%d: examples/s %s", r + 1, config.repeats, line)
    return measured
