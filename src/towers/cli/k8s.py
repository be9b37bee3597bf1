"""``towers k8s``: Kubernetes manifests (or a SLURM script) for a multi-machine job."""

from __future__ import annotations

import argparse
import sys

from towers.errors import InvalidArgumentError

__all__ = ["add_k8s_parser", "run_k8s"]


def add_k8s_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("k8s", help="render Kubernetes manifests (or a SLURM script) for a multi-machine job",
                       description="Print (or write with -o) the manifests that run `towers launch SCRIPT` on "
                                   "--nnodes machines: a Kubeflow Trainer v2 TrainJob (default), a Kubeflow v1 "
                                   "PyTorchJob, a plain Indexed Job, or an sbatch script.")
    p.add_argument("--name", required=True, help="job name (DNS-1123: lower-case letters, digits, '-')")
    p.add_argument("--image", help="container image with towers and the script (Kubernetes kinds)")
    p.add_argument("--kind", choices=("trainjob", "pytorchjob", "indexed-job", "slurm"), default="trainjob",
                   help="trainjob: Kubeflow Trainer v2 (default); pytorchjob: Kubeflow training operator v1; "
                        "indexed-job: plain Kubernetes; slurm: an sbatch script")
    p.add_argument("--nnodes", type=int, default=1, help="machines (pods or SLURM nodes)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1", help="processes per machine: N, auto, gpu, cpu")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs requested per machine (nvidia.com/gpu)")
    p.add_argument("--cpus-per-node", help="CPUs requested per machine, e.g. 16")
    p.add_argument("--memory-per-node", help="memory requested per machine, e.g. 64Gi")
    p.add_argument("--namespace", default="default", help="Kubernetes namespace")
    p.add_argument("--strategy", help="passed to towers launch --strategy")
    p.add_argument("--num-ps", "--num_ps", type=int, default=None, help="passed to towers launch --num-ps")
    p.add_argument("--max-restarts", type=int, default=3, help="worker-group restarts inside the job (torchrun's)")
    p.add_argument("--backoff-limit", type=int, default=6, help="pod restarts before Kubernetes fails the job")
    p.add_argument("--strategy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of --strategy passed to every node's towers launch (repeatable), e.g. mode=async")
    p.add_argument("--mesh", default=None, metavar="DIMS",
                   help="--strategy sharded: the job's processes as a device mesh, e.g. dp=2,tp=2 (passed on as "
                        "--strategy-option mesh=DIMS)")
    p.add_argument("--grace-period", type=int, default=60, dest="grace_period_s",
                   help="seconds between a preemption's SIGTERM and the kill (terminationGracePeriodSeconds; SLURM: "
                        "--signal=TERM@N): every rank saves a checkpoint in it (default 60)")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: the runtime's for trainjob, "
                                                          "23456 pytorchjob, 29500 indexed-job, 15000 + job id %% 20000 "
                                                          "slurm)")
    p.add_argument("--checkpoint-pvc", help="existing PersistentVolumeClaim for checkpoints (default: render <name>-ckpt)")
    p.add_argument("--checkpoint-size", default="10Gi", help="size of the rendered checkpoint claim")
    p.add_argument("--checkpoint-dir", help="checkpoint directory in the job, exported as TOWERS_CHECKPOINT_DIR")
    p.add_argument("--checkpoint-access-mode", choices=("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"),
                   help="access mode of the rendered claim (default: ReadWriteOnce on 1 node, which every default "
                        "storage class binds; ReadWriteMany on several nodes, which needs a shared-file class)")
    p.add_argument("--checkpoint-storage-class", help="storage class of the rendered claim (default: the cluster's)")
    p.add_argument("--runtime", default="torch-distributed",
                   help="Kubeflow Trainer v2 runtime of a trainjob (default: torch-distributed)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment variable")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--time", dest="time_limit", help="SLURM time limit, e.g. 24:00:00")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument("-o", "--output", help="write here instead of printing")
    p.add_argument("script", help="training script (path inside the image / on the cluster)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(run=run_k8s)


def run_k8s(args: argparse.Namespace) -> int:
    from towers.cluster.strategy_options import parse_strategy_options
    from towers.deploy import DeploySpec, render
    from towers.launch.spec import with_mesh

    try:
        env = dict(item.split("=", 1) for item in args.env if "=" in item)
        if len(env) != len(args.env):
            raise InvalidArgumentError(f"--env expects KEY=VALUE. Received: {args.env!r}. Example: --env NCCL_DEBUG=INFO.")
        spec = DeploySpec(
            name=args.name, image=args.image, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
            gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node, memory_per_node=args.memory_per_node,
            namespace=args.namespace, strategy=args.strategy, num_ps=args.num_ps,
            strategy_options=with_mesh(parse_strategy_options(args.strategy_option), args.mesh),
            max_restarts=args.max_restarts,
            backoff_limit=args.backoff_limit, grace_period_s=args.grace_period_s, port=args.port,
            checkpoint_pvc=args.checkpoint_pvc,
            checkpoint_size=args.checkpoint_size, checkpoint_dir=args.checkpoint_dir,
            checkpoint_access_mode=args.checkpoint_access_mode, checkpoint_storage_class=args.checkpoint_storage_class,
            runtime=args.runtime, env=env,
            partition=args.partition, time_limit=args.time_limit, module=args.module, script=args.script,
            script_args=tuple(args.script_args))
        if spec.strategy is not None and spec.strategy_options:
            # What every process of `towers launch` checks as it builds the strategy: refused here, before the
            # manifest exists, instead of in every pod.
            from towers.strategies.base import check_strategy_options

            check_strategy_options(spec.strategy, spec.strategy_options)
        text = render(spec, args.kind)
    except ValueError as exc:
        print(f"towers k8s: error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"towers k8s: wrote {args.kind} for {args.name!r} to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
