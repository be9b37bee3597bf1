"""``towers bench``: speed-up and efficiency per replica count and strategy, against raw DDP."""

from __future__ import annotations

import argparse
import sys

from towers.errors import InvalidArgumentError

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speed-up and efficiency per replica count and strategy vs raw DDP",
                       description="Train a model (the seed CNN, or yours with --model) with each strategy and with "
                       "hand-written torch DDP, interleaved on the same processes (a GPU per replica when there are enough, "
                       "else CPU cores); print examples/s, speed-up, weak-scaling efficiency, the towers/raw ratio, CPU "
                       "ms/step and peak memory; write JSON and a PNG.")
    p.add_argument("--replicas", default="1,2", help="comma-separated replica counts (default: 1,2)")
    from towers.bench.config import STRATEGIES

    p.add_argument("--strategies", default="mirrored", help=f"comma-separated: {', '.join(STRATEGIES)} "
                   "(raw DDP is always measured beside them; default: mirrored)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed run (default: 5)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median is reported (default: 5)")
    p.add_argument("--interleave-steps", type=int, default=5,
                   help="engines take turns every this many timed steps; 0: once per repeat (default: 5)")
    p.add_argument("--batch-size", type=int, default=64, help="per-replica batch size (default: 64)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="optimizer (default: sgd)")
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="your model: a function or class returning an nn.Module, e.g. mypkg.models:build_model or "
                        "path/to/file.py:Net (default: the seed CNN)")
    p.add_argument("--input-shape", default="1,28,28", metavar="C,H,W",
                   help="shape of one input example for --model, without the batch dimension (default: 1,28,28)")
    p.add_argument("--num-classes", type=int, default=10, help="labels of the random data for --model (default: 10)")
    p.add_argument("--dataset", metavar="MODULE:FACTORY",
                   help="your data for --model: a function returning a dataset of (input, target) pairs "
                        "(default: random inputs of --input-shape)")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                   help="loss for --model: cross_entropy (class labels) or mse (targets shaped like the output)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="deadline of each replica count's job in seconds (default: from the amount of work)")
    p.add_argument("--out-dir", default="towers-out/bench", help="where bench.json and bench.png go")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from towers.bench.config import BenchConfig, parse_replicas, parse_shape, parse_strategies

    try:
        config = BenchConfig(
            replicas=parse_replicas(args.replicas), strategies=parse_strategies(args.strategies), steps=args.steps,
            warmup=args.warmup, repeats=args.repeats, interleave_steps=args.interleave_steps,
            batch_size=args.batch_size, threads=args.threads,
            optimizer=args.optimizer, timeout_s=args.timeout_s, model=args.model, dataset=args.dataset,
            input_shape=parse_shape(args.input_shape), num_classes=args.num_classes, loss=args.loss)
        if config.model is not None:  # find and try the user's model here, before any process starts
            from towers.bench.user_model import check_user_workload

            print(f"towers bench: {check_user_workload(config.workload_spec())}", file=sys.stderr)
        out_dir = Path(args.out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise InvalidArgumentError(f"--out-dir must be a directory. Received: {str(out_dir)!r}, which is a file. "
                                       "Pass another path.")
    except ValueError as exc:
        print(f"towers bench: error: {exc}", file=sys.stderr)
        return 2
    from towers.bench.runner import run_benchmark
    from towers.launch import SpawnError

    try:
        report = run_benchmark(config, progress=lambda line: print(f"towers bench: {line}", file=sys.stderr))
    except SpawnError as exc:
        print(f"towers bench: the benchmark job failed.\n{exc}", file=sys.stderr)
        return 1
    written = [report.to_json(out_dir / "bench.json")]
    if not args.no_plot:
        try:
            written.append(report.plot(out_dir / "bench.png"))
        except ImportError as exc:
            print(f"towers bench: warning: {exc}", file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_table())
    for path in written:  # under --json, stdout stays pure JSON
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
