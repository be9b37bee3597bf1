"""The ``towers`` command: ``main(argv) -> int``, one ``add_<cmd>_parser``/``run_<cmd>`` pair per subcommand.

Each ``run_<cmd>`` parses nothing itself: it builds a spec from the parsed flags, calls the module
that does the work, prints, and returns an exit code.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

__all__ = ["main"]


# --- towers devices ---------------------------------------------------------------------------
def add_devices_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="list devices, the torch version and distributed backends")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run_devices)


def run_devices(args: argparse.Namespace) -> int:
    import json

    from towers.devices import describe_devices, format_devices

    report = describe_devices()
    print(json.dumps(report, indent=2) if args.json else format_devices(report))
    return 0


# --- towers launch ----------------------------------------------------------------------------
def add_launch_parser(sub: argparse._SubParsersAction) -> None:
    # Everything after `launch` (torchrun's flags, --strategy, --num-ps, the script and its args) is
    # parsed by run_launch with torchrun's own parser, so `towers --help` does not import torch.
    p = sub.add_parser("launch", help="run a script on N processes (torchrun's flags, plus --strategy and --num-ps)",
                       add_help=False, prefix_chars="\0")
    p.add_argument("launch_argv", nargs=argparse.REMAINDER)
    p.set_defaults(run=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    from towers.launch.launcher import LaunchError, launch
    from towers.launch.spec import parse_launch_args

    try:
        spec = parse_launch_args(args.launch_argv)
        launch(spec)
    except LaunchError as exc:
        print(f"towers launch: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:
        print(f"towers launch: error: {exc}", file=sys.stderr)
        return 2
    return 0


# --- towers demo ------------------------------------------------------------------------------
def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the seed CNN on bundled digits with 1 and then 2 replicas")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    raise NotImplementedError("towers demo")


# --- towers bench -----------------------------------------------------------------------------
def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speed-up and efficiency per replica count and strategy vs raw DDP",
                       description="Train the seed CNN on synthetic data with each strategy and with hand-written "
                       "torch DDP, interleaved on the same processes; print examples/s, speed-up, weak-scaling "
                       "efficiency and the towers/raw ratio; write JSON and a PNG.")
    p.add_argument("--replicas", default="1,2", help="comma-separated replica counts (default: 1,2)")
    p.add_argument("--strategies", default="mirrored", help="comma-separated: mirrored, ps_async, ps_sync "
                   "(raw DDP is always measured beside them; default: mirrored)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per repeat (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed run (default: 5)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats; the median is reported (default: 5)")
    p.add_argument("--batch-size", type=int, default=64, help="per-replica batch size (default: 64)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="optimizer (default: sgd)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="deadline of each replica count's job in seconds (default: from the amount of work)")
    p.add_argument("--out-dir", default="towers-out/bench", help="where bench.json and bench.png go")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from towers.bench.config import BenchConfig, parse_replicas, parse_strategies

    try:
        config = BenchConfig(
            replicas=parse_replicas(args.replicas), strategies=parse_strategies(args.strategies), steps=args.steps,
            warmup=args.warmup, repeats=args.repeats, batch_size=args.batch_size, threads=args.threads,
            optimizer=args.optimizer, timeout_s=args.timeout_s)
        out_dir = Path(args.out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"--out-dir must be a directory. Received: {str(out_dir)!r}, which is a file. "
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


# --- towers k8s -------------------------------------------------------------------------------
def add_k8s_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("k8s", help="render Kubernetes manifests (or a SLURM script) for a multi-machine job")
    p.set_defaults(run=run_k8s)


def run_k8s(args: argparse.Namespace) -> int:
    raise NotImplementedError("towers k8s")


_PARSERS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_devices_parser,
    add_launch_parser,
    add_demo_parser,
    add_bench_parser,
    add_k8s_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """Return the ``towers`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="towers", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _PARSERS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``towers`` command line and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("towers: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
