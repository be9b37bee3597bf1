"""Host (Python) time per step that towers adds, on a model so small that the step is all host time.

``nn.Linear(32, 10)``, batch 256, Adam, mean cross-entropy, one torch thread, OneDeviceStrategy on
the CPU. Three engines, interleaved in one process (the order rotates every repeat):

- ``raw``: a hand-written loop: a shuffled order, tensors sliced from it, ``F.cross_entropy``,
  ``backward``, ``step``, ``zero_grad``; the loss kept on the device (no ``.item()``);
- ``loop``: towers' custom loop: ``strategy.prepare``, ``strategy.distribute_dataset``,
  ``strategy.run`` of the same step with ``towers.compute_average_loss``;
- ``fit``: ``Trainer.fit`` with ``metrics=["accuracy"]`` and the default callbacks.

A step's time is taken between the ends of consecutive steps (start-up is out). Reported: us per
step of each (median over the repeats) and the overhead of ``loop`` and ``fit`` over ``raw``, in
microseconds per step (median of the per-repeat differences, and their range). On a GPU whose
steps are short, this overhead is what stands between the engines and the device.

    python benchmarks/host_overhead.py                     # 7 repeats x 300 steps (~1 min)
    python benchmarks/host_overhead.py --profile fit       # cProfile of fit's steps, top 25 by own time
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from trainer_vs_loop import StepClock, towers_loop  # shared with the Trainer-vs-loop benchmark

import towers


def _us(times: list[float]) -> float:
    """Microseconds per step from the end of the 2nd step (the first iteration's set-up is out)."""
    return 1e6 * (times[-1] - times[1]) / (len(times) - 2)


def _engines(steps: int, batch_size: int) -> dict[str, Callable[[], float]]:
    torch.manual_seed(0)
    n = steps * batch_size
    x, y = torch.randn(n, 32), torch.randint(0, 10, (n,))

    raw_net = nn.Linear(32, 10)
    raw_opt = torch.optim.Adam(raw_net.parameters(), lr=1e-3)

    def raw() -> float:
        times, losses = [], []
        order = torch.randperm(n)
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            xb, yb = x[idx], y[idx]
            loss = F.cross_entropy(raw_net(xb), yb)
            loss.backward()
            raw_opt.step()
            raw_opt.zero_grad()
            losses.append(loss.detach())
            times.append(time.perf_counter())
        torch.stack(losses).sum()
        return _us(times)

    strategy = towers.OneDeviceStrategy("cpu")
    loop_net = nn.Linear(32, 10)
    model, opt = strategy.prepare(loop_net, torch.optim.Adam(loop_net.parameters(), lr=1e-3))
    loop_data = torch.utils.data.TensorDataset(x, y)

    timed_loop = towers_loop(strategy, model, opt, loop_data, batch_size)

    def loop() -> float:
        return _us(timed_loop())

    fit_strategy = towers.OneDeviceStrategy("cpu")
    fit_net = nn.Linear(32, 10)
    trainer = towers.Trainer(fit_net, torch.optim.Adam(fit_net.parameters(), lr=1e-3), F.cross_entropy,
                             metrics=["accuracy"], strategy=fit_strategy)

    def fit() -> float:
        times: list[float] = []
        trainer.fit((x, y), epochs=1, global_batch_size=batch_size, callbacks=[StepClock(times)])
        return _us(times)

    return {"raw": raw, "loop": loop, "fit": fit}


def _profile(engine: Callable[[], float], top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    engine()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    """Time the three engines interleaved and print us per step and the overheads (or profile one engine)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="steps per repeat and engine (default: 300)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats (default: 7)")
    p.add_argument("--batch-size", type=int, default=256, help="batch (default: 256)")
    p.add_argument("--profile", choices=("raw", "loop", "fit"), default=None, help="cProfile this engine instead")
    p.add_argument("--top", type=int, default=25, help="functions shown with --profile (default: 25)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engines = _engines(args.steps, args.batch_size)
    for fn in engines.values():  # warm-up
        fn()
    if args.profile:
        _profile(engines[args.profile], args.top)
        return 0
    names = list(engines)
    rows: list[dict[str, float]] = []
    for r in range(args.repeats):
        order = names[r % 3:] + names[:r % 3]
        rows.append({name: engines[name]() for name in order})
    print(f"nn.Linear(32, 10), batch {args.batch_size}, Adam, 1 thread, CPU: {args.steps} steps x {args.repeats} "
          "repeats, interleaved")
    for name in names:
        print(f"  {name:>4}: {statistics.median(r[name] for r in rows):7.1f} us/step")
    for name in ("loop", "fit"):
        extra = [r[name] - r["raw"] for r in rows]
        print(f"  {name} - raw: {statistics.median(extra):7.1f} us/step (range {min(extra):.1f} to {max(extra):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
