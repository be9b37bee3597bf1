"""Benchmark results: per-repeat throughputs, the maths on them, and the table, JSON and PNG that show them."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from towers.errors import InvalidArgumentError

__all__ = ["RAW", "Measurement", "Row", "BenchReport", "summarize"]

#: Strategy name of the hand-written baseline (plain torch on 1 replica, DDP on more).
RAW = "raw_ddp"

_SERIES = ("examples_per_s", "cpu_ms_per_step", "raw_examples_per_s", "raw_cpu_ms_per_step", "base_examples_per_s")


@dataclass(frozen=True)
class Measurement:
    """One strategy at one replica count: global examples/s and CPU ms/step (mean over ranks) of each repeat."""

    strategy: str
    replicas: int
    engine: str
    examples_per_s: tuple[float, ...]
    cpu_ms_per_step: tuple[float, ...] = ()
    #: Raw DDP measured in the same job, repeat by repeat: the denominators of the ratios (empty: use the raw row).
    raw_examples_per_s: tuple[float, ...] = ()
    raw_cpu_ms_per_step: tuple[float, ...] = ()
    #: The same engine on 1 replica in the same job, repeat by repeat: speed-up denominators (empty: the 1-replica row).
    base_examples_per_s: tuple[float, ...] = ()
    #: Peak memory of the busiest process of the job, MiB (GPU memory allocated on GPUs, resident memory on CPUs).
    memory_mib: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InvalidArgumentError(f"replicas must be >= 1. Received: {self.replicas}.")
        if not self.examples_per_s:
            raise InvalidArgumentError(f"{self.strategy} at {self.replicas} replicas has no repeats; expected at least one.")
        if self.cpu_ms_per_step and len(self.cpu_ms_per_step) != len(self.examples_per_s):
            raise InvalidArgumentError(f"{self.strategy} at {self.replicas} replicas has {len(self.examples_per_s)} throughputs "
                                       f"but {len(self.cpu_ms_per_step)} CPU times; expected one of each per repeat.")
        for name in _SERIES:
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    @property
    def median(self) -> float:
        """Median examples/s over the repeats."""
        return statistics.median(self.examples_per_s)

    @property
    def cpu_ms(self) -> float | None:
        """Median CPU milliseconds per step (None when not measured)."""
        return statistics.median(self.cpu_ms_per_step) if self.cpu_ms_per_step else None


@dataclass(frozen=True)
class Row:
    """One line of the table: medians and the ratios derived from them (None where undefined)."""

    strategy: str
    replicas: int
    engine: str
    median: float
    low: float
    high: float
    speedup: float | None
    efficiency: float | None
    vs_raw: float | None
    cpu_ms: float | None = None
    cpu_vs_raw: float | None = None
    memory_mib: float | None = None
    #: Median tokens/s (a token model's workload) and model-FLOPs utilisation (0..1; needs the device's peak).
    tokens_per_s: float | None = None
    mfu: float | None = None


@dataclass
class BenchReport:
    """Everything one ``towers bench`` run measured, plus the settings and the machine it ran on."""

    measurements: list[Measurement]
    config: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: The workload's training step counted once: ``flops_per_example``, ``tokens_per_example`` (token models),
    #: ``peak_flops`` (one device's, FLOP/s) and ``peak_label`` (its source); empty when not measured.
    model_flops: dict[str, Any] = field(default_factory=dict)

    # --- maths -------------------------------------------------------------------------------------
    def get(self, strategy: str, replicas: int) -> Measurement | None:
        """Return the measurement of ``strategy`` at ``replicas``, or None."""
        return next((m for m in self.measurements if m.strategy == strategy and m.replicas == replicas), None)

    def strategies(self) -> list[str]:
        """Return the strategies measured, raw DDP first, then in order of appearance."""
        names = list(dict.fromkeys(m.strategy for m in self.measurements))
        return sorted(names, key=lambda s: s != RAW)

    def replica_counts(self) -> list[int]:
        """Return the replica counts measured, ascending."""
        return sorted({m.replicas for m in self.measurements})

    def speedup(self, strategy: str, replicas: int) -> float | None:
        """Return throughput at ``replicas`` over the same strategy's at 1 replica (None without a baseline).

        With a 1-replica series from the same job: the median of the per-repeat ratios; otherwise
        the ratio of the medians of the two rows.
        """
        m, base = self.get(strategy, replicas), self.get(strategy, 1)
        if m is not None and m.base_examples_per_s:
            return statistics.median(a / b for a, b in zip(m.examples_per_s, m.base_examples_per_s) if b > 0)
        if m is None or base is None or base.median <= 0:
            return None
        return m.median / base.median

    def efficiency(self, strategy: str, replicas: int) -> float | None:
        """Return weak-scaling efficiency: throughput_N / (N * throughput_1) (None without a baseline)."""
        s = self.speedup(strategy, replicas)
        return None if s is None else s / replicas

    def _raw_series(self, m: Measurement, field_name: str) -> tuple[float, ...]:
        paired = getattr(m, "raw_" + field_name)
        if paired:
            return paired
        raw = self.get(RAW, m.replicas)
        return getattr(raw, field_name) if raw is not None else ()

    def ratios_vs_raw(self, strategy: str, replicas: int) -> list[float]:
        """Return strategy/raw throughput per repeat (repeats were interleaved, so pairs share conditions)."""
        m = self.get(strategy, replicas)
        if m is None:
            return []
        return [a / b for a, b in zip(m.examples_per_s, self._raw_series(m, "examples_per_s")) if b > 0]

    def ratio_vs_raw(self, strategy: str, replicas: int) -> float | None:
        """Return the median over repeats of strategy/raw throughput (None when raw was not measured)."""
        ratios = self.ratios_vs_raw(strategy, replicas)
        return statistics.median(ratios) if ratios else None

    def cpu_ratio_vs_raw(self, strategy: str, replicas: int) -> float | None:
        """Return the median over repeats of strategy/raw CPU time per step (> 1: the strategy costs more CPU)."""
        m = self.get(strategy, replicas)
        raw_cpu = self._raw_series(m, "cpu_ms_per_step") if m is not None else ()
        if m is None or not m.cpu_ms_per_step or not raw_cpu:
            return None
        return statistics.median(a / b for a, b in zip(m.cpu_ms_per_step, raw_cpu) if b > 0)

    def rows(self) -> list[Row]:
        """Return one table row per measurement, ordered by replica count then strategy (raw first)."""
        order = {s: i for i, s in enumerate(self.strategies())}
        rows = []
        for m in sorted(self.measurements, key=lambda m: (m.replicas, order[m.strategy])):
            rows.append(Row(m.strategy, m.replicas, m.engine, m.median, min(m.examples_per_s), max(m.examples_per_s),
                            self.speedup(m.strategy, m.replicas), self.efficiency(m.strategy, m.replicas),
                            None if m.strategy == RAW else self.ratio_vs_raw(m.strategy, m.replicas), m.cpu_ms,
                            None if m.strategy == RAW else self.cpu_ratio_vs_raw(m.strategy, m.replicas),
                            m.memory_mib, *self._rates(m)))
        return rows

    def _rates(self, m: Measurement) -> tuple[float | None, float | None]:
        """Median tokens/s and MFU of ``m`` from the workload's FLOPs per example and one device's peak."""
        f = self.model_flops
        tokens = m.median * f["tokens_per_example"] if f.get("tokens_per_example") else None
        mfu = (m.median * f["flops_per_example"] / (f["peak_flops"] * m.replicas)
               if f.get("flops_per_example") and f.get("peak_flops") else None)
        return tokens, mfu

    def _rate_columns(self) -> tuple[str, ...]:
        f = self.model_flops
        return (("tokens/s",) if f.get("tokens_per_example") else ()) + (
            ("MFU",) if f.get("flops_per_example") and f.get("peak_flops") else ())

    def _rate_cells(self, r: Row) -> tuple[str, ...]:
        cells = {"tokens/s": "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
                 "MFU": _fmt(None if r.mfu is None else 100 * r.mfu, "%", 1)}
        return tuple(cells[c] for c in self._rate_columns())

    # --- outputs -----------------------------------------------------------------------------------
    def to_table(self) -> str:
        """Return the results as an aligned text table, with a line saying how to read it."""
        header = ("strategy", "replicas", "engine", "examples/s", "[min-max]", "speed-up", "efficiency", "vs raw DDP",
                  "CPU ms/step", "CPU vs raw", "peak MiB", *self._rate_columns())
        lines = [header]
        for r in self.rows():
            lines.append((r.strategy, str(r.replicas), r.engine, f"{r.median:,.0f}", f"[{r.low:,.0f}-{r.high:,.0f}]",
                          _fmt(r.speedup, "x"), _fmt(r.efficiency), "-" if r.strategy == RAW else _fmt(r.vs_raw),
                          _fmt(r.cpu_ms, "", 1), "-" if r.strategy == RAW else _fmt(r.cpu_vs_raw, "", 3),
                          _fmt(r.memory_mib, "", 0), *self._rate_cells(r)))
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        right = {1, 3, 4, 5, 6, 7, 8, 9, 10, *range(11, len(header))}
        out = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
               for line in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        c = self.config
        if c:
            out.append("")
            shape = "x".join(str(d) for d in c.get("input_shape") or ())
            out.append(f"model: {c['model']} (input {shape or '?'}" + (f", data {c['dataset']}" if c.get("dataset") else "")
                       + f", loss {c.get('loss', 'cross_entropy')})" if c.get("model") else
                       "model: the seed CNN on synthetic 28x28 images (towers bench --model module:factory measures yours)")
            out.append(f"examples/s: global, median of {c.get('repeats', '?')} repeats of {c.get('steps', '?')} "
                       f"steps (after {c.get('warmup', '?')} warm-up), engines taking turns every "
                       f"{c.get('interleave_steps') or c.get('steps', '?')} steps; per-replica batch "
                       f"{c.get('batch_size', '?')}, {c.get('threads', '?')} thread(s) per process.")
        out.append("speed-up and efficiency: vs the same strategy on 1 replica, per repeat when both ran in one job "
                   "(weak scaling: efficiency = throughput_N / (N * throughput_1)). vs raw DDP: median of per-repeat "
                   "ratios of examples/s.")
        out.append("CPU ms/step: process CPU time (all threads) per step, mean over ranks; CPU vs raw: median of "
                   "per-repeat ratios (> 1: towers spends more CPU per step). Robust to other programs on the cores.")
        out.append("peak MiB: the busiest process of the job (both engines share it): GPU memory allocated by torch on "
                   "GPUs, resident memory (torch itself included) on CPUs.")
        f = self.model_flops
        if "MFU" in header:
            out.append(f"MFU: model FLOPs/s over the peak of the replicas' devices; {f['flops_per_example']:,.0f} FLOPs per "
                       "example (one forward and backward, counted by torch's FlopCounterMode), peak per device: "
                       f"{f.get('peak_label')}.")
        out.extend(self.notes)
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data, derived numbers included."""
        return {
            "config": self.config,
            "environment": self.environment,
            "notes": list(self.notes),
            "measurements": [{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(m).items()}
                             for m in self.measurements],
            "rows": [asdict(r) for r in self.rows()],
            "model_flops": dict(self.model_flops),
        }

    def to_json(self, path: str | Path) -> Path:
        """Write the report as JSON to ``path`` (parent folders created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BenchReport":
        """Return the report ``to_dict`` produced (derived rows are recomputed)."""
        return cls(measurements=[Measurement(m["strategy"], int(m["replicas"]), m["engine"],
                                             **{k: tuple(m.get(k, ())) for k in _SERIES},
                                             memory_mib=m.get("memory_mib")) for m in data["measurements"]],
                   config=dict(data.get("config", {})), environment=dict(data.get("environment", {})),
                   notes=list(data.get("notes", [])), model_flops=dict(data.get("model_flops") or {}))

    @classmethod
    def from_json(cls, path: str | Path) -> "BenchReport":
        """Return the report stored at ``path`` by ``to_json``."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def plot(self, path: str | Path) -> Path:
        """Write a PNG: examples/s and efficiency per replica count, each strategy beside raw DDP; return the path.

        Raises:
            ImportError: when matplotlib is not installed, saying how to install it.
        """
        from towers.bench.plot import plot_report

        return plot_report(self, path)


def _fmt(value: float | None, suffix: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def summarize(report: BenchReport, strategies: Sequence[str] | None = None) -> list[str]:
    """Return one sentence per strategy and replica count: ratio vs raw DDP and both efficiencies."""
    lines = []
    for s in strategies or [s for s in report.strategies() if s != RAW]:
        for n in report.replica_counts():
            ratio = report.ratio_vs_raw(s, n)
            if ratio is None:
                continue
            eff, raw_eff = report.efficiency(s, n), report.efficiency(RAW, n)
            text = f"{s} at {n} replica(s): towers/raw = {ratio:.3f}"
            cpu = report.cpu_ratio_vs_raw(s, n)
            if cpu is not None:
                text += f" (CPU per step: towers/raw = {cpu:.3f})"
            if n > 1 and eff is not None and raw_eff is not None:
                text += f"; weak-scaling efficiency 1->{n}: {s} {eff:.2f}, raw DDP {raw_eff:.2f}"
            lines.append(text)
    return lines
