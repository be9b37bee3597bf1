"""The ``towers`` command: ``main(argv) -> int``, one ``add_<cmd>_parser``/``run_<cmd>`` pair per subcommand.

Each subcommand lives in a module of its own here (``devices``, ``launch``, ``demo``, ``bench``,
``plan``, ``k8s``, ``doctor``, ``verify``). Each ``run_<cmd>`` parses nothing itself: it builds a
spec from the parsed flags, calls the module that does the work, prints, and returns an exit code.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from towers.cli.bench import add_bench_parser
from towers.cli.demo import add_demo_parser
from towers.cli.devices import add_devices_parser
from towers.cli.doctor import add_doctor_parser
from towers.cli.k8s import add_k8s_parser
from towers.cli.launch import add_launch_parser
from towers.cli.plan import add_plan_parser
from towers.cli.verify import add_verify_parser

__all__ = ["main"]


_PARSERS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_devices_parser,
    add_launch_parser,
    add_demo_parser,
    add_bench_parser,
    add_plan_parser,
    add_k8s_parser,
    add_doctor_parser,
    add_verify_parser,
)


_DESCRIPTION = """\
Data-parallel training on PyTorch across devices and machines: run one training script on 1
CPU, N GPUs or N machines (mirrored replicas, parameter servers), and measure how close to Nx
the speed-up is."""

_EPILOG = """\
examples:
  towers demo                                             train on 1 and 2 replicas, compare speed
  towers devices                                          what this machine has
  towers launch --nproc-per-node 2 --strategy mirrored train.py
  towers bench --replicas 1,2                             scaling of the built-in CNN
  towers bench --model mypkg.models:build --input-shape 3,32,32   scaling of your model
  towers k8s --name job --image me/train:1 --nnodes 2 train.py    Kubernetes manifests

`towers COMMAND --help` describes each command. Python API: `import towers`."""


def _version() -> str:
    import platform

    from towers import __version__

    return f"towers {__version__} (Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    """Return the ``towers`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="towers", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=_version(),
                        help="print the towers and Python versions, then exit")
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
    from towers._logging import configure_logging

    configure_logging()  # the command's own runs: [rank r/w] lines, INFO from the chief
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("towers: interrupted", file=sys.stderr)
        return 130
