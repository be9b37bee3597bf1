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


# --- towers demo ------------------------------------------------------------------------------
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


# --- towers bench -----------------------------------------------------------------------------
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


# --- towers plan ------------------------------------------------------------------------------
def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="estimate each replica's memory before launching: parameters, gradients, "
                                    "optimizer state, activations, peak",
                       description="Build your model on the meta device (no memory used), count what each replica "
                       "keeps for a strategy and replica count, and trace one step on fake tensors for the "
                       "activations; print a table per replica count.")
    p.add_argument("--model", metavar="MODULE:FACTORY", required=True,
                   help="your model: a function or class returning an nn.Module, e.g. mypkg.models:build_model or "
                        "path/to/file.py:Net")
    p.add_argument("--strategy", default="mirrored", help="mirrored or sharded (FSDP2) (default: mirrored)")
    p.add_argument("--replicas", default="1,2,4", help="comma-separated replica counts (default: 1,2,4)")
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
    from towers.plan import estimate_memory_table, format_table

    try:
        factory = load_factory(args.model, "--model")
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


# --- towers k8s -------------------------------------------------------------------------------
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
            raise ValueError(f"--env expects KEY=VALUE. Received: {args.env!r}. Example: --env NCCL_DEBUG=INFO.")
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


# --- towers doctor ----------------------------------------------------------------------------
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
            raise ValueError(f"--node-rank needs --nnodes. Received: --node-rank {args.node_rank}. "
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


# --- towers verify ----------------------------------------------------------------------------
def _verify_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategies", default="mirrored,sharded", help="comma-separated strategies (default: mirrored,sharded)")
    p.add_argument("--replicas", default="2", help="comma-separated replica counts, each >= 2 (default: 2)")
    p.add_argument("--steps", type=int, default=5, help="updates to compare (default: 5)")
    p.add_argument("--plain", action="store_true",
                   help="a script without towers (torch DDP reading RANK/WORLD_SIZE): run with torchrun's variables; "
                        "{world_size} or {64 // world_size} in its arguments is filled per run")
    p.add_argument("--keep-dropout", action="store_true", help="leave dropout on (runs then differ by design)")
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
    try:
        spec = VerifySpec(script=args.script, args=tuple(rest), steps=args.steps, plain=args.plain,
                          strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
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


if __name__ == "__main__":
    sys.exit(main())
