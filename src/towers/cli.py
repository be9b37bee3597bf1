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
    p = sub.add_parser("launch", help="run a script on N processes (torchrun's flags, plus --strategy and --num-ps)")
    p.set_defaults(run=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    raise NotImplementedError("towers launch")


# --- towers demo ------------------------------------------------------------------------------
def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the seed CNN on bundled digits with 1 and then 2 replicas")
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    raise NotImplementedError("towers demo")


# --- towers bench -----------------------------------------------------------------------------
def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speed-up and efficiency per replica count and strategy vs raw DDP")
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    raise NotImplementedError("towers bench")


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
