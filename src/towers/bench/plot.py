"""The benchmark's PNG: examples/s and weak-scaling efficiency per replica count, each strategy beside raw DDP."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from towers.bench.report import BenchReport

__all__ = ["plot_report"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "towers bench needs matplotlib to draw its plot, and it is not installed. "
            "Install it with `pip install 'towers[plot]'` (or `pip install matplotlib`), "
            "or pass --no-plot to skip the PNG.") from exc
    matplotlib.use("Agg", force=True)  # files only: never open a window, work without a display
    import matplotlib.pyplot as plt

    return plt


def plot_report(report: "BenchReport", path: str | Path) -> Path:
    """Write ``report`` as a two-panel grouped-bar PNG at ``path`` and return the path.

    Raises:
        ImportError: when matplotlib is missing, with the install command.
    """
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    strategies, counts = report.strategies(), report.replica_counts()
    width = 0.8 / max(1, len(strategies))
    fig, (ax_tp, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, strategy in enumerate(strategies):
        xs, medians, err_low, err_high, effs = [], [], [], [], []
        for j, n in enumerate(counts):
            m = report.get(strategy, n)
            if m is None:
                continue
            x = j + (i - (len(strategies) - 1) / 2) * width
            xs.append(x)
            medians.append(m.median)
            err_low.append(m.median - min(m.examples_per_s))
            err_high.append(max(m.examples_per_s) - m.median)
            effs.append(report.efficiency(strategy, n))
        label = "raw DDP (hand-written torch)" if strategy == "raw_ddp" else f"towers {strategy}"
        hatch = "//" if strategy == "raw_ddp" else None
        ax_tp.bar(xs, medians, width, yerr=[err_low, err_high], capsize=3, label=label, hatch=hatch)
        eff_xs = [x for x, e in zip(xs, effs) if e is not None]
        bars = ax_eff.bar(eff_xs, [e for e in effs if e is not None], width, label=label, hatch=hatch)
        ax_eff.bar_label(bars, fmt="%.2f", fontsize=8)
    for ax in (ax_tp, ax_eff):
        ax.set_xticks(range(len(counts)))
        ax.set_xticklabels([str(n) for n in counts])
        ax.set_xlabel("replicas")
        ax.grid(axis="y", alpha=0.3)
    ax_tp.set_ylabel("examples/s (global, median; bars: min-max)")
    ax_tp.set_title("Throughput")
    ax_tp.legend(fontsize=8)
    ax_eff.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax_eff.set_ylabel("throughput_N / (N * throughput_1)")
    ax_eff.set_title("Weak-scaling efficiency")
    ax_eff.set_ylim(0, 1.15)
    c = report.config
    fig.suptitle(f"towers bench: seed CNN, per-replica batch {c.get('batch_size', '?')}, "
                 f"{c.get('threads', '?')} thread(s)/process, {c.get('repeats', '?')} interleaved repeats", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
