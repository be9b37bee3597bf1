"""The Trainer's step breakdown at its default period against the breakdown off, same process, interleaved.

Seed CNN on synthetic [B, 1, 28, 28] images, batch 64, Adam, one torch thread, OneDeviceStrategy on
the CPU. Each repeat runs ``Trainer.fit`` for S steps with ``breakdown_every=None`` (the default
period) and with ``breakdown_every=0``, alternating which goes first; a step's time is taken between
the ends of consecutive steps (wall) and as the process's CPU time over the same steps. Reported: ms
per step of each, and on/off ratios, median and range over the repeats. Goal: <= 1.01.

    python benchmarks/breakdown_overhead.py --repeats 7 --steps 200
"""

from __future__ import annotations

import argparse
import logging

from _on_off import StepClock, ms, report, seed_cnn_trainer

from towers.training.callbacks.breakdown import DEFAULT_BREAKDOWN_EVERY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2 * DEFAULT_BREAKDOWN_EVERY)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    logging.getLogger("towers").setLevel(logging.WARNING)  # the summary lines are not the subject here
    trainer, data = seed_cnn_trainer(args.steps, args.batch_size)
    results: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    trainer.fit(data, epochs=1, global_batch_size=args.batch_size)  # warm-up
    for repeat in range(args.repeats):
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        for name in order:
            trainer.breakdown_every = None if name == "on" else 0
            clock = StepClock()
            trainer.fit(data, epochs=1, global_batch_size=args.batch_size, callbacks=[clock])
            results[name].append((ms(clock.wall), ms(clock.cpu)))
    print(f"seed CNN, batch {args.batch_size}, 1 thread, {args.steps} steps x {args.repeats} repeats, "
          f"breakdown every {DEFAULT_BREAKDOWN_EVERY} steps (on) vs breakdown_every=0 (off)")
    report(results)


if __name__ == "__main__":
    main()
