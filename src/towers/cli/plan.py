"""``towers plan``: each replica's memory, estimated before launching."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_plan_parser", "run_plan"]


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="estimate each replica's (or, with --mesh, each rank's) memory before "
                                    "launching: parameters, gradients, optimizer state, activations, peak",
                       description="Build your model on the meta device (no memory used), count what each replica "
                       "keeps for a strategy and replica count, and trace one step on fake tensors for the "
                       "activations; print a table per replica count, or with --mesh one column per rank of the layout.")
    p.add_argument("--model", metavar="MODULE:FACTORY", required=True,
                   help="your model: a function or class returning an nn.Module, e.g. mypkg.models:build_model or "
                        "path/to/file.py:Net")
    p.add_argument("--strategy", default="mirrored", help="mirrored or sharded (FSDP2) (default: mirrored)")
    p.add_argument("--replicas", default="1,2,4", help="comma-separated replica counts (default: 1,2,4; without --mesh)")
    p.add_argument("--mesh", default=None, metavar="DIMS",
                   help="a parallel layout, as towers launch --mesh takes it (e.g. dp=2,tp=2 or pp=2,dp=2): print each "
                        "rank's memory under it instead of one column per replica count")
    p.add_argument("--processes", type=int, default=None,
                   help="with --mesh: the job's processes (default: the mesh's own size; a dp left out takes the rest)")
    p.add_argument("--pp-microbatches", type=int, default=None,
                   help="with a pp mesh: micro-batches per step (default: one per stage, as the sharded strategy)")
    p.add_argument("--batch-size", type=int, default=32, help="per-replica batch size (default: 32)")
    p.add_argument("--input-shape", default=None, metavar="C,H,W",
                   help="shape of one float input example, without the batch dimension (e.g. 3,32,32)")
    p.add_argument("--seq-len", type=int, default=None, help="token models: tokens per example (inputs are token ids)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token models: ids below this (default: the model's first nn.Embedding's size)")
    p.add_argument("--precision", default="32", help="32, bf16 or fp16 (default: 32)")
    p.add_argument("--optimizer", default="adam", help="sgd, momentum, adam or adamw (default: adam)")
    p.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                   help="cross_entropy (class ids over the output's last dimension) or mse (default: cross_entropy)")
    p.add_argument("--json", action="store_true", help="print the estimates as JSON instead of the table")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import json

    from towers.bench.config import parse_replicas, parse_shape
    from towers.bench.user_model import load_factory
    from towers.errors import user_error
    from towers.plan import estimate_layout, estimate_memory_table, format_layout_table, format_table

    try:
        factory = load_factory(args.model, "--model")
        if args.mesh is not None:
            layout = estimate_layout(
                factory, mesh=args.mesh, world_size=args.processes, strategy=args.strategy,
                batch_size=args.batch_size,
                input_shape=None if args.input_shape is None else parse_shape(args.input_shape), seq_len=args.seq_len,
                vocab_size=args.vocab_size, precision=args.precision, optimizer=args.optimizer, loss=args.loss,
                pp_microbatches=args.pp_microbatches)
            print(json.dumps(layout.to_dict(), indent=2) if args.json else format_layout_table(layout,
                                                                                               model_name=args.model))
            return 0
        if args.processes is not None or args.pp_microbatches is not None:
            raise user_error("--processes and --pp-microbatches describe a parallel layout", "them without --mesh",
                             "Add --mesh (e.g. --mesh dp=2,tp=2), or use --replicas for replica counts.")
        estimates = estimate_memory_table(
            factory, replicas=parse_replicas(args.replicas), strategy=args.strategy, batch_size=args.batch_size,
            input_shape=None if args.input_shape is None else parse_shape(args.input_shape), seq_len=args.seq_len,
            vocab_size=args.vocab_size, precision=args.precision, optimizer=args.optimizer, loss=args.loss)
    except (ValueError, TypeError) as exc:
        print(f"towers plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([e.to_dict() for e in estimates], indent=2))
    else:
        print(format_table(estimates, model_name=args.model))
    return 0
