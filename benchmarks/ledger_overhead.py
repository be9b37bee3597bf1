"""The ledger of committed updates (``ExampleLedger``) against no ledger: Trainer.fit, same process, interleaved.

Seed CNN on synthetic [B, 1, 28, 28] images, batch 64, Adam, one torch thread, OneDeviceStrategy on
the CPU (the ledger's cost is per process and per step: one line written per step, whatever the
replica count). Each repeat runs ``Trainer.fit`` for S steps with an ``ExampleLedger`` writing to a
temporary directory and without one, alternating which goes first; a step's time is taken between
the ends of consecutive steps (wall) and as the process's CPU time over the same steps. Reported: ms
per step of each, and on/off ratios, median and range over the repeats. Goal: <= 1.01. On a busy machine
the ratios' spread exceeds the effect, so the ledger's own time per step is also timed alone (the callback's
work for one step, 20,000 times) and reported as a share of the step.

    python benchmarks/ledger_overhead.py --repeats 7 --steps 200
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

from _on_off import StepClock, ms, report, seed_cnn_trainer

import towers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    logging.getLogger("towers").setLevel(logging.WARNING)
    trainer, data = seed_cnn_trainer(args.steps, args.batch_size)
    results: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    trainer.fit(data, epochs=1, global_batch_size=args.batch_size)  # warm-up
    with tempfile.TemporaryDirectory() as run_dir:
        for repeat in range(args.repeats):
            order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
            for name in order:
                clock = StepClock()
                extra = [towers.callbacks.ExampleLedger(run_dir)] if name == "on" else []
                trainer.fit(data, epochs=1, global_batch_size=args.batch_size, callbacks=[*extra, clock])
                results[name].append((ms(clock.wall), ms(clock.cpu)))
        ledger = towers.callbacks.ExampleLedger(run_dir)
        ledger.set_trainer(trainer)
        ledger.on_train_begin()
        logs = {"global_step": 1.0}
        start = time.perf_counter()
        for i in range(20_000):
            ledger.on_train_batch_end(i, logs)
        per_step_us = (time.perf_counter() - start) / 20_000 * 1e6
        ledger.on_train_end()
    print(f"seed CNN, batch {args.batch_size}, 1 thread, {args.steps} steps x {args.repeats} repeats, "
          "ExampleLedger (on) vs none (off)")
    report(results)
    step_ms = statistics.median(r[0] for r in results["off"])
    print(f"the ledger alone: {per_step_us:.1f} us per step = {per_step_us / 10 / step_ms:.3f}% of a {step_ms:.2f} ms step")


if __name__ == "__main__":
    main()
