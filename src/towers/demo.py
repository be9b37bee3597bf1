"""``towers demo``: train the seed CNN on bundled digits with 1 replica, then N, and measure the speed-up.

The two training runs use the same seed, data order and global batch, so by the "same maths"
invariant their loss curves coincide. Their speed is *strong scaling* (a fixed global batch split
N ways), which on a few CPU cores is often slower with more replicas: each replica's step shrinks
while the per-step costs (all-reduce, Python) do not. So the speed-up is measured as users scale
in practice, by *weak scaling*: each replica keeps the 1-replica batch (``towers bench``'s
measurement, interleaved in one job). The CLI prints; this module returns results and writes files.
"""

from __future__ import annotations

import csv
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from towers._logging import get_logger
from towers.cluster import roles
from towers.errors import InvalidArgumentError

__all__ = ["DemoSpec", "DemoRun", "train", "run_replicated", "measure_scaling", "write_history_csv", "plot_losses",
           "summary_rows", "summary_lines"]

log = get_logger(__name__)

#: The demo's multi-replica strategies: every replicated strategy of the table (no ps tasks).
_MULTI_STRATEGIES = tuple(e.name for e in roles.STRATEGIES if e.multi_process and not e.has_ps)


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """What the demo trains: strategy for the multi-replica run, replicas, epochs, batch, data, outputs."""

    strategy: str = "mirrored"
    replicas: int = 2
    epochs: int = 8
    global_batch_size: int = 64
    learning_rate: float = 3e-3
    #: the learning rate is multiplied by this after every epoch (Adam on digits settles at >= 0.95)
    lr_decay: float = 0.6
    data: str = "digits"
    out_dir: Path = Path("towers-out/demo")
    seed: int = 0
    timeout_s: float = 600.0
    #: weak-scaling measurement: timed steps per repeat and repeats (0 repeats: skip it)
    scaling_steps: int = 20
    scaling_repeats: int = 3

    def __post_init__(self) -> None:
        strategy = self.strategy.lower().replace("-", "_")
        if strategy not in _MULTI_STRATEGIES:
            raise InvalidArgumentError(f"--strategy must be one of {', '.join(_MULTI_STRATEGIES)}. Received: {self.strategy!r}.")
        object.__setattr__(self, "strategy", strategy)
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise InvalidArgumentError(f"--replicas must be a positive integer. Received: {self.replicas!r}.")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise InvalidArgumentError(f"--epochs must be a positive integer. Received: {self.epochs!r}.")
        if not isinstance(self.global_batch_size, int) or self.global_batch_size < self.replicas:
            raise InvalidArgumentError(f"--global-batch-size must be >= the number of replicas ({self.replicas}). "
                                       f"Received: {self.global_batch_size!r}. Use a larger batch or fewer replicas.")
        if not self.learning_rate > 0:
            raise InvalidArgumentError(f"learning_rate must be > 0. Received: {self.learning_rate!r}.")
        if not 0 < self.lr_decay <= 1:
            raise InvalidArgumentError(f"lr_decay must be in (0, 1]. Received: {self.lr_decay!r}.")
        if self.data != "digits" and not (self.data.startswith("mnist:") and len(self.data) > len("mnist:")):
            raise InvalidArgumentError(f"--data must be 'digits' or 'mnist:/path/to/idx/folder'. Received: {self.data!r}.")
        if not isinstance(self.scaling_steps, int) or self.scaling_steps < 1:
            raise InvalidArgumentError(f"--scaling-steps must be a positive integer. Received: {self.scaling_steps!r}.")
        if not isinstance(self.scaling_repeats, int) or self.scaling_repeats < 0:
            raise InvalidArgumentError(f"--scaling-repeats must be an integer >= 0 (0 skips the speed measurement). "
                                       f"Received: {self.scaling_repeats!r}.")
        if self.timeout_s <= 0:
            raise InvalidArgumentError(f"timeout_s must be > 0 seconds. Received: {self.timeout_s!r}.")
        object.__setattr__(self, "out_dir", Path(self.out_dir))


@dataclass(frozen=True)
class DemoRun:
    """One training run: its strategy, replicas, test metrics, training speed and per-epoch history."""

    strategy: str
    replicas: int
    test_loss: float
    test_accuracy: float
    train_seconds: float
    examples_per_second: float
    history: Mapping[str, Sequence[float]] = field(default_factory=dict)


def _decayed(epoch: int, lr: float, *, initial: float, decay: float) -> float:
    return initial * decay ** epoch


def _throughput_callback() -> Any:
    from towers.training.callbacks import Callback

    class Throughput(Callback):
        """Time spent in training steps (no validation, no first epoch when there are more), and their examples."""

        def __init__(self) -> None:
            super().__init__()
            self.seconds, self.examples, self._t0, self._counting = 0.0, 0, 0.0, True

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            # The first epoch warms up (allocations, DDP buckets): measure the steady state after it.
            self._counting = epoch > 0 or self.params.get("epochs", 1) == 1
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            now = time.perf_counter()
            if self._counting:
                self.seconds += now - self._t0
                self.examples += int((logs or {}).get("size", 0))
            self._t0 = now

    return Throughput()


def train(spec: DemoSpec, strategy_name: str, *, show_progress: bool = True) -> DemoRun:
    """Train the seed CNN under ``strategy_name`` (from this process's environment) and return the run.

    Call it on every replica; every replica returns the same metrics.
    """
    import torch
    import torch.nn.functional as F

    from towers.datasets import load_data_spec
    from towers.models import SeedCNN
    from towers.strategies import get_strategy
    from towers.training import Trainer
    from towers.training.callbacks import LearningRateScheduler, ProgressBar

    train_set, test_set = load_data_spec(spec.data)
    strategy = get_strategy(strategy_name) if strategy_name == "one_device" else _strategy_from_env()
    try:
        torch.manual_seed(spec.seed)
        with strategy.scope():
            model = SeedCNN()
            optimizer = torch.optim.Adam(model.parameters(), lr=spec.learning_rate)
        trainer = Trainer(model, optimizer, F.cross_entropy, metrics=["accuracy"], strategy=strategy, seed=spec.seed)
        meter = _throughput_callback()
        schedule = LearningRateScheduler(functools.partial(_decayed, initial=spec.learning_rate, decay=spec.lr_decay))
        callbacks = [schedule, meter, *([ProgressBar()] if show_progress else [])]
        history = trainer.fit(train_set, spec.epochs, spec.global_batch_size, validation_data=test_set,
                              callbacks=callbacks)
        test = trainer.evaluate(test_set, spec.global_batch_size)
        replicas = strategy.num_replicas_in_sync
    finally:
        strategy.shutdown()
    seconds = meter.seconds
    return DemoRun(strategy=strategy.name, replicas=replicas, test_loss=test["loss"], test_accuracy=test["accuracy"],
                   train_seconds=seconds, examples_per_second=meter.examples / seconds if seconds > 0 else 0.0,
                   history={k: list(v) for k, v in history.history.items()})


def _strategy_from_env() -> Any:
    from towers.strategies import strategy_from_env

    return strategy_from_env()


def _replica_main(spec: DemoSpec) -> DemoRun:
    return train(spec, spec.strategy)


def run_replicated(spec: DemoSpec) -> DemoRun:
    """Train on ``spec.replicas`` local processes (``towers.spawn``, one CPU thread each) and return rank 0's run.

    Raises:
        SpawnError: when a replica fails or the run exceeds ``spec.timeout_s``.
    """
    from towers.launch import spawn

    results = spawn(_replica_main, spec.replicas, args=(spec,), timeout_s=spec.timeout_s,
                    env={"TOWERS_STRATEGY": spec.strategy}, threads_per_process=1)
    return results[0]


def train_single(spec: DemoSpec) -> DemoRun:
    """Train on one replica in this process, with one CPU thread (like each replica of the N-replica run)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(spec, "one_device")
    finally:
        torch.set_num_threads(threads)


def measure_scaling(spec: DemoSpec, *, progress: Any = None) -> Any:
    """Measure weak scaling of the seed CNN, 1 vs ``spec.replicas`` replicas, each with ``global_batch_size`` examples.

    Returns a ``towers.bench.BenchReport`` (MirroredStrategy beside hand-written DDP, interleaved in
    one job), or None when there is nothing to compare (1 replica, or ``scaling_repeats=0``).

    Raises:
        SpawnError: when the measuring job fails or passes its deadline.
    """
    if spec.replicas < 2 or spec.scaling_repeats == 0:
        return None
    from towers.bench.config import BenchConfig
    from towers.bench.runner import run_benchmark

    config = BenchConfig(replicas=(1, spec.replicas), strategies=("mirrored",), steps=spec.scaling_steps,
                         warmup=3, repeats=spec.scaling_repeats, interleave_steps=5,
                         batch_size=spec.global_batch_size, threads=1, optimizer="adam", lr=spec.learning_rate,
                         seed=spec.seed)
    return run_benchmark(config, progress=progress or (lambda line: log.info("%s", line)))


def summary_lines(spec: DemoSpec, runs: Sequence[DemoRun], scaling: Any = None) -> list[str]:
    """Return the demo's closing tables as text lines: the same-maths runs, then weak-scaling speed."""
    lines = [f"same maths: global batch {spec.global_batch_size} on every run",
             f"{'replicas':>8}  {'strategy':<22} {'test acc':>8} {'final loss':>10} {'train s':>8}"]
    for run in runs:
        loss = (run.history.get("loss") or [math.nan])[-1]
        lines.append(f"{run.replicas:>8}  {run.strategy:<22} {run.test_accuracy:>8.4f} {loss:>10.4f} "
                     f"{run.train_seconds:>8.1f}")
    lines.append(f"Same seed, data order and global batch: the loss curves coincide ({spec.out_dir / 'loss.png'}).")
    if scaling is None:
        return lines
    n, b = spec.replicas, spec.global_batch_size
    lines += ["", f"speed: weak scaling, {b} examples per replica per step (seed CNN, median of "
                  f"{spec.scaling_repeats} interleaved repeat{'s' if spec.scaling_repeats != 1 else ''})",
              f"{'replicas':>8}  {'examples/s':>10}  {'speed-up':>8}  {'efficiency':>10}"]
    for replicas in (1, n):
        m = scaling.get("mirrored", replicas)
        speedup = scaling.speedup("mirrored", replicas) if replicas > 1 else 1.0
        efficiency = speedup / replicas if speedup is not None else None
        lines.append(f"{replicas:>8}  {m.median:>10,.0f}  {_fmt(speedup, 'x'):>8}  {_fmt(efficiency):>10}")
    strong = runs[-1].examples_per_second / runs[0].examples_per_second \
        if len(runs) > 1 and runs[0].examples_per_second > 0 else math.nan
    weak = scaling.speedup("mirrored", n)
    cores = scaling.environment.get("cores", "?")
    what = (f"Strong scaling (the runs above: the global batch of {b} split {n} ways, {b // n} per replica) measured "
            f"{strong:.2f}x")
    why = (f"it adds no work per step, so each replica's step shrinks {n}-fold while the per-step cost (gradient "
           "all-reduce, Python) does not")
    if weak is None or not strong > weak:
        lines.append(f"{what}: {why}; with {n} processes on {cores} CPU cores it stays below weak scaling, often "
                     "below 1x.")
    else:  # only load from other programs makes it come out higher: say so rather than explain it away
        lines.append(f"{what}, above weak scaling: the two runs were timed apart, and other programs on the machine "
                     "slowed the 1-replica run more (the weak-scaling runs take turns in one job, so load hits both "
                     f"alike). On an idle machine it stays below: {why}.")
    lines.extend(scaling.notes)
    return lines


def _fmt(value: float | None, suffix: str = "") -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}{suffix}"


def summary_rows(runs: Sequence[DemoRun]) -> list[dict[str, Any]]:
    """Return one row per run: replicas, strategy, test accuracy, examples/s, speed-up and efficiency vs the first run."""
    base = runs[0].examples_per_second if runs else 0.0
    rows = []
    for run in runs:
        speedup = run.examples_per_second / base if base > 0 else math.nan
        rows.append({"replicas": run.replicas, "strategy": run.strategy, "test_accuracy": run.test_accuracy,
                     "test_loss": run.test_loss, "examples_per_second": run.examples_per_second,
                     "train_seconds": run.train_seconds, "speedup": speedup, "efficiency": speedup / run.replicas})
    return rows


def write_history_csv(runs: Sequence[DemoRun], path: str | Path) -> Path:
    """Write every run's per-epoch history (one row per run and epoch) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for run in runs for k in run.history})
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["replicas", "strategy", "epoch", *keys])
        for run in runs:
            epochs = max((len(v) for v in run.history.values()), default=0)
            for epoch in range(epochs):
                writer.writerow([run.replicas, run.strategy, epoch + 1,
                                 *(repr(run.history[k][epoch]) if k in run.history else "" for k in keys)])
    return path


def plot_losses(runs: Sequence[DemoRun], path: str | Path) -> Path:
    """Plot training and validation loss per epoch of every run to a PNG and return its path.

    Raises:
        ImportError: when matplotlib is missing, saying how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("The loss plot needs matplotlib, which is not installed. "
                          "Install it with: pip install 'towers[plot]'.") from exc
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # Same seed and global batch: the curves coincide, so later runs are drawn as crosses on top.
    for run, (style, marker, size) in zip(runs, (("-", "o", 4), ("--", "x", 8), (":", "+", 10), ("-.", "1", 10))):
        label = f"{run.replicas} replica{'s' if run.replicas > 1 else ''} ({run.strategy})"
        for key, color in (("loss", "tab:blue"), ("val_loss", "tab:orange")):
            values = run.history.get(key)
            if values:
                ax.plot(range(1, len(values) + 1), values, style, color=color, marker=marker, markersize=size,
                        label=f"{key} — {label}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("Seed CNN on digits: 1 and N replicas follow the same curve")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
