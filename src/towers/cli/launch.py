"""``towers launch``: a script on N processes, with torchrun's flags plus towers' own."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_launch_parser", "run_launch"]


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
        if spec.strategy is not None and spec.strategy_options:
            # What every process checks as it builds the strategy: refused here, before any process starts.
            from towers.strategies.base import check_strategy_options

            check_strategy_options(spec.strategy, spec.strategy_options)
        launch(spec)
    except LaunchError as exc:
        print(f"towers launch: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:
        print(f"towers launch: error: {exc}", file=sys.stderr)
        return 2
    return 0
