"""``towers demo``: the seed CNN on bundled digits with 1 and then N replicas, and the speed-up."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_demo_parser", "run_demo"]


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the seed CNN on bundled digits with 1 and then 2 replicas")
    from towers.cluster import roles

    replicated = [e.name for e in roles.STRATEGIES if e.multi_process and not e.has_ps]
    p.add_argument("--strategy", default="mirrored", help="strategy of the multi-replica run: "
                   f"{', '.join(replicated)} (default: mirrored)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (processes) of the second run (default 2)")
    p.add_argument("--epochs", type=int, default=8, help="epochs of each run (default 8)")
    p.add_argument("--global-batch-size", type=int, default=64, help="examples per step, all replicas together (default 64)")
    p.add_argument("--data", default="digits", help="'digits' (bundled, default) or 'mnist:/path/to/idx/folder'")
    p.add_argument("--out-dir", default="towers-out/demo",
                   help="where history.csv and loss.png go (default towers-out/demo)")
    p.add_argument("--scaling-steps", type=int, default=20,
                   help="timed steps per repeat of the weak-scaling speed measurement (default 20)")
    p.add_argument("--scaling-repeats", type=int, default=3,
                   help="repeats of the speed measurement; 0 skips it (default 3)")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    from towers import demo
    from towers.launch import SpawnError

    try:
        spec = demo.DemoSpec(strategy=args.strategy, replicas=args.replicas, epochs=args.epochs,
                             global_batch_size=args.global_batch_size, data=args.data, out_dir=args.out_dir,
                             scaling_steps=args.scaling_steps, scaling_repeats=args.scaling_repeats)
    except ValueError as exc:
        print(f"towers demo: {exc}", file=sys.stderr)
        return 2
    print(f"towers demo: seed CNN on {spec.data}, {spec.epochs} epoch{'s' if spec.epochs != 1 else ''}, "
          f"global batch {spec.global_batch_size}, "
          "one CPU thread per replica", flush=True)
    runs, scaling = [], None
    parts = 3 if spec.replicas > 1 and spec.scaling_repeats else 2
    try:
        print(f"\n[1/{parts}] 1 replica (one_device)", flush=True)
        runs.append(demo.train_single(spec))
        print(f"      test accuracy {runs[-1].test_accuracy:.4f}", flush=True)
        print(f"\n[2/{parts}] {spec.replicas} replicas ({spec.strategy}, {spec.replicas} processes)", flush=True)
        runs.append(demo.run_replicated(spec))
        print(f"      test accuracy {runs[-1].test_accuracy:.4f}", flush=True)
        if parts == 3:
            print(f"\n[3/{parts}] speed: 1 vs {spec.replicas} replicas, {spec.global_batch_size} examples per replica "
                  "per step (weak scaling)", flush=True)
            scaling = demo.measure_scaling(spec, progress=lambda line: print(f"      {line}", flush=True))
    except (FileNotFoundError, ValueError, SpawnError) as exc:
        print(f"towers demo: {exc}", file=sys.stderr)
        return 1
    print()
    for line in demo.summary_lines(spec, runs, scaling):
        print(line)
    written = [demo.write_history_csv(runs, spec.out_dir / "history.csv")]
    try:
        written.append(demo.plot_losses(runs, spec.out_dir / "loss.png"))
    except ImportError as exc:
        print(f"towers demo: no plot: {exc}", file=sys.stderr)
    print("\nwrote:")
    for path in written:
        print(f"  {path}")
    return 0
