"""``towers doctor``: the pre-flight checks and measurements of each node of a job."""

from __future__ import annotations

import argparse
import sys

from towers.errors import InvalidArgumentError

__all__ = ["add_doctor_parser", "run_doctor"]


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="pre-flight on each node: names, interface, rendezvous, latency, bandwidth",
                       description="Run on every node of a job (or as `towers launch ... -m towers.doctor`): checks "
                                   "this host's name, the interface the job's links bind, that the rendezvous is "
                                   "reachable, then measures pairwise latency, bandwidth, clock offset and all-reduce "
                                   "bus bandwidth between the nodes, and says what to fix. Under a launcher or "
                                   "TF_CONFIG it reads the job from the environment. Exit code 1 when a check fails.")
    p.add_argument("--nnodes", type=int, default=None, help="nodes taking part (one doctor process each)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's rank, 0..nnodes-1")
    p.add_argument("--master-addr", "--master_addr", default=None, help="node 0's address, as the job will use it")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rendezvous port (default across nodes: 29500, as towers launch)")
    p.add_argument("--interface", default=None, help="network interface to check (default: the one the job would pick)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for the other nodes (default 60)")
    p.add_argument("--size-mb", type=float, default=16.0, help="message size of the bandwidth tests (default 16)")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each measurement (default 5)")
    p.set_defaults(run=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from towers import cluster
    from towers.doctor import DoctorSpec, format_report
    from towers.doctor import run_doctor as check

    try:
        spec = DoctorSpec(timeout_s=args.timeout_s, size_mb=args.size_mb, repeats=args.repeats)
        explicit: dict = {"interface": args.interface} if args.interface else {}
        if args.nnodes is not None:
            node_rank = 0 if args.node_rank is None else args.node_rank
            explicit.update(world_size=args.nnodes, rank=node_rank, node_rank=node_rank, local_rank=0,
                            local_world_size=1)
            if args.nnodes > 1 and args.master_port is None:
                explicit["master_port"] = 29500
        elif args.node_rank is not None:
            raise InvalidArgumentError(f"--node-rank needs --nnodes. Received: --node-rank {args.node_rank}. "
                                       "Example: towers doctor --nnodes 2 --node-rank 1 --master-addr NODE0.")
        if args.master_addr:
            explicit["master_addr"] = args.master_addr
        if args.master_port is not None:
            explicit["master_port"] = args.master_port
        info = cluster.from_env(**explicit)
    except ValueError as exc:
        print(f"towers doctor: error: {exc}", file=sys.stderr)
        return 2
    report = check(info, spec, progress=lambda line: print(f"towers doctor: {line}", file=sys.stderr, flush=True))
    print(format_report(report, tables=info.local_rank == 0), flush=True)
    return 0 if report.ok else 1
