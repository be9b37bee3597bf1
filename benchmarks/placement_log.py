"""Cost of ``towers.log_device_placement`` on a forward+backward step of the seed CNN.

Variants, run interleaved in one process (noise on this host is +-20% run to run):

* ``off``        no placement log (no dispatch mode installed)
* ``on, logger`` log every op to ``towers.devices.placement`` at INFO, which has a NullHandler
                 (a LogRecord is built and handled for every op; nothing is written)
* ``on, list``   collect ``PlacementRecord``s in a list, logger off (``to_logger=False``)
* ``empty mode``  a TorchDispatchMode that only runs the op: the floor any dispatch-mode logger pays

The second table times a tiny op (``torch.add`` on 4 floats), which isolates the per-op cost.

Usage: python benchmarks/placement_log.py [--repeats 15] [--steps 10] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from towers.devices import PlacementRecord, log_device_placement
from towers.models import SeedCNN


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _off() -> Iterator[None]:
    yield


@contextlib.contextmanager
def _on_logger() -> Iterator[None]:
    with log_device_placement(True):
        yield


@contextlib.contextmanager
def _on_list() -> Iterator[None]:
    records: list[PlacementRecord] = []
    with log_device_placement(True, records=records, to_logger=False):
        yield


class _EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "off": _off,
    "on, logger (NullHandler)": _on_logger,
    "on, list": _on_list,
    "empty mode (floor)": _EmptyMode,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timed rounds per variant")
    parser.add_argument("--steps", type=int, default=10, help="forward+backward steps per round")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    placement = logging.getLogger("towers.devices.placement")
    placement.addHandler(logging.NullHandler())
    placement.propagate = False  # keep the per-op lines off stderr; they still get built and handled
    placement.setLevel(logging.INFO)

    model = SeedCNN()
    x = torch.randn(args.batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch_size,))

    counted: list[PlacementRecord] = []
    with log_device_placement(True, records=counted, to_logger=False):
        _step(model, x, y)
    ops_per_step = len(counted)

    for _ in range(3):  # warm-up: allocator, oneDNN kernels
        for make in VARIANTS.values():
            with make():
                _step(model, x, y)

    per_step_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
            with VARIANTS[name]():
                start = time.perf_counter()
                for _ in range(args.steps):
                    _step(model, x, y)
                elapsed = time.perf_counter() - start
            per_step_ms[name].append(1e3 * elapsed / args.steps)

    # Overhead from paired rounds (variant / off in the same round), so drift in the host's load cancels.
    off = per_step_ms["off"]
    print(f"torch {torch.__version__}, 1 thread, seed CNN fwd+bwd, batch {args.batch_size}, "
          f"{ops_per_step} ops/step, {args.repeats} interleaved rounds x {args.steps} steps")
    print(f"{'variant':<26} {'median ms':>9} {'min ms':>8} {'overhead (paired median)':>25} {'us/op':>7}")
    for name, samples in per_step_ms.items():
        ratio = statistics.median(s / o for s, o in zip(samples, off))
        extra_us = 1e3 * (ratio - 1) * statistics.median(off) / ops_per_step
        print(f"{name:<26} {statistics.median(samples):9.2f} {min(samples):8.2f} "
              f"{100 * (ratio - 1):+24.1f}% {extra_us:7.1f}")

    # The step's kernels dwarf the per-op cost; a tiny op shows it without that noise.
    tiny = torch.ones(4)
    per_op_us: dict[str, list[float]] = {name: [] for name in VARIANTS}
    n_ops = 2000
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with VARIANTS[name]():
                start = time.perf_counter()
                for _ in range(n_ops):
                    torch.add(tiny, 1)
                per_op_us[name].append(1e6 * (time.perf_counter() - start) / n_ops)
    print()
    print(f"tiny op (torch.add on 4 floats), {args.repeats} interleaved rounds x {n_ops} ops")
    print(f"{'variant':<26} {'median us/op':>12} {'min us/op':>10} {'added (median)':>15}")
    base_us = statistics.median(per_op_us["off"])
    for name, samples in per_op_us.items():
        med = statistics.median(samples)
        print(f"{name:<26} {med:12.2f} {min(samples):10.2f} {med - base_us:+15.2f}")


if __name__ == "__main__":
    main()
