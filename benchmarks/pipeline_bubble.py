"""The bubble of every pipeline schedule towers runs, from the actions torch's schedules lay out: no job, no process.

For each ``pp_schedule`` (the seven of ``torch.distributed.pipelining``), each ``pp`` and each
micro-batch count, this builds torch's schedule over stand-in stages (what a schedule reads of a
stage: its index, the stage count, the pipeline's size) and takes its per-rank action lists, as a
training step does at its first step (``towers.parallel.pipeline_schedules``). The bubble is
the idle fraction of the step those actions make on a clock where a forward takes 1 slot, a
backward 2 (its input and weight parts 1 each), and each action waits for its process and for what
it needs: idle slots over all slots (processes x the step's length). Sends and receives are free
here; on a real link they add to the waits, most where the schedules with two stages per process
send twice as often. A count a schedule cannot run says what towers runs instead (the same stages,
another schedule) and its bubble.

    python benchmarks/pipeline_bubble.py                      # pp 2 and 4, 4 and 8 micro-batches
    python benchmarks/pipeline_bubble.py --pp 2 4 8 --microbatches 4 8 16 --json-out bubble.json

Results go in BENCHMARKS.md ("Pipeline schedules: the bubble").
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from towers.parallel.pipeline_schedules import (
    SCHEDULES,
    bubble_fraction,
    runnable_schedule,
    schedule_actions,
    schedule_spec,
)


def bubble(name: str, pp: int, microbatches: int) -> dict[str, Any]:
    """The bubble of ``name`` over ``microbatches`` on ``pp`` processes (or of what towers runs instead)."""
    runs, reason = runnable_schedule(name, microbatches, pp)
    if reason is not None and runs == name:  # no schedule with the same stages takes it
        return {"schedule": name, "pp": pp, "microbatches": microbatches, "bubble": None, "note": reason}
    spec = schedule_spec(runs)
    fraction = bubble_fraction(schedule_actions(runs, pp, microbatches), spec.num_stages(pp))
    return {"schedule": name, "pp": pp, "microbatches": microbatches, "stages": spec.num_stages(pp),
            "bubble": fraction, "runs": runs, "note": reason}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    rows = [bubble(name, pp, n) for name in SCHEDULES for pp in args.pp for n in args.microbatches]
    columns = [(pp, n) for pp in args.pp for n in args.microbatches]
    print("bubble: idle slots / all slots of one step (forward 1, backward 2), from torch's per-rank actions")
    print(f"{'pp_schedule':<26}" + "".join(f"{f'pp={pp} m={n}':>14}" for pp, n in columns))
    for name in SCHEDULES:
        cells = []
        for pp, n in columns:
            row = next(r for r in rows if (r["schedule"], r["pp"], r["microbatches"]) == (name, pp, n))
            cell = "-" if row["bubble"] is None else f"{row['bubble']:.3f}"
            cells.append(cell + ("*" if row.get("runs") not in (None, name) else ""))
        print(f"{name:<26}" + "".join(f"{c:>14}" for c in cells))
    print("1F1B / GPipe in theory: (pp - 1) / (m + pp - 1); interleaved with 2 stages per process: "
          "(pp - 1) / (2 m + pp - 1)")
    for row in rows:
        if row.get("runs") not in (None, row["schedule"]):
            print(f"* {row['schedule']} at pp={row['pp']}, m={row['microbatches']}: {row['note']}; towers runs "
                  f"{row['runs']} (the same stages): that bubble")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
