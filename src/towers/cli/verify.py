"""``towers verify``: a script run as one process and under each strategy, compared; or a ledger proved."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_verify_parser", "run_verify"]


def _verify_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategies", default=None,
                   help="comma-separated strategies (default: mirrored,sharded)")
    p.add_argument("--replicas", default="2", help="comma-separated replica counts, each >= 2 (default: 2)")
    p.add_argument("--steps", type=int, default=5, help="updates to compare (default: 5)")
    p.add_argument("--plain", action="store_true",
                   help="a script without towers (torch DDP reading RANK/WORLD_SIZE): run with torchrun's variables; "
                        "{world_size} or {64 // world_size} in its arguments is filled per run")
    p.add_argument("--keep-dropout", action="store_true", help="leave dropout on (runs then differ by design)")
    p.add_argument("--bitwise", type=int, default=None, metavar="MICRO_BATCH",
                   help="run everything under bitwise=True with micro_batch_size=MICRO_BATCH and compare with "
                        "torch.equal: any differing bit is a difference (docs/bitwise.md)")
    p.add_argument("--tolerance", type=float, default=None, help="largest difference relative to a tensor's scale "
                                                                  "counted as rounding (default: 1e-3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds all runs may take together (default: 300)")
    p.add_argument("--keep", metavar="DIR", default=None, help="keep the captures and each process's output in DIR")
    p.add_argument("--ledger", metavar="RUN_DIR", default=None,
                   help="instead of running a script: prove from a finished (or killed) job's ledger in RUN_DIR that each "
                        "example of each completed epoch was trained exactly once")


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="run a script for a few updates as one process and under each strategy; "
                                      "compare the parameters and name the cause of a difference")
    _verify_options(p)
    p.add_argument("script", nargs="?", default=None, help="the training script, run unchanged")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="after `--`: the script's arguments")
    p.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from towers.verify import DEFAULT_TOLERANCE, VerifySpec, verify

    if args.ledger is not None:
        return _prove_ledger(args)
    if args.script is None:
        print("towers verify: error: no script given. Received: nothing after `towers verify`. Pass your training "
              "script (`towers verify train.py`) or a job's ledger (`towers verify --ledger RUN_DIR`).", file=sys.stderr)
        return 2
    rest = list(args.script_args)
    if "--" in rest:  # flags of ours after the script name, then the script's own arguments
        cut = rest.index("--")
        options = argparse.ArgumentParser(prog="towers verify")
        _verify_options(options)
        options.parse_args(rest[:cut], namespace=args)
        rest = rest[cut + 1:]
    try:
        replicas = tuple(int(n) for n in args.replicas.split(",") if n.strip())
    except ValueError:
        print(f"towers verify: error: --replicas takes comma-separated whole numbers. Received: {args.replicas!r}. "
              "Use e.g. --replicas 2,3.", file=sys.stderr)
        return 2
    strategies = args.strategies or "mirrored,sharded"
    try:
        spec = VerifySpec(script=args.script, args=tuple(rest), steps=args.steps, plain=args.plain,
                          strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()), bitwise=args.bitwise,
                          replicas=replicas,
                          keep_dropout=args.keep_dropout, timeout_s=args.timeout, workdir=args.keep,
                          tolerance=DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance)
    except ValueError as exc:
        print(f"towers verify: error: {exc}", file=sys.stderr)
        return 2
    report = verify(spec)
    print(report.format(), flush=True)
    if report.reference_error is not None:
        return 2
    return 0 if report.ok else 1


def _prove_ledger(args: argparse.Namespace) -> int:
    from towers.ledger import prove_ledger

    if args.script is not None:
        print(f"towers verify: error: --ledger proves a finished job's ledger and runs no script. Received: "
              f"--ledger {args.ledger} and the script {args.script!r}. Use one of them.", file=sys.stderr)
        return 2
    try:
        proof = prove_ledger(args.ledger)
    except (OSError, ValueError) as exc:
        print(f"towers verify: error: {exc}", file=sys.stderr)
        return 2
    print(proof.format(), flush=True)
    return 0 if proof.ok else 1
