"""FaultTolerantStrategy (torchft): recovery times after a killed replica group, and the steady-state cost.

Two replica groups of one process each, a lighthouse in this process, all on loopback.

* ``recovery`` (``--repeats`` times): both groups train the seed CNN (batch 64 per group); after
  ``--kill-after`` steps group 1 is SIGKILLed and at once started again (what a launcher does).
  Measured: kill -> the survivor's next committed step (a step the killed group cannot have
  been part of), and kill -> the restarted group's first committed step (it healed from the
  survivor and is back in the quorum; includes starting Python and importing torch). The two
  groups must end with equal parameters.
* ``steady``: in the same 2 processes, interleaved blocks of ``--steps`` steps under
  MirroredStrategy (DDP over a torch.distributed Gloo group), under FaultTolerantStrategy (one
  flat all-reduce of the gradients at the end of backward over torchft's per-quorum Gloo group, a
  quorum and a commit vote per step), and under FaultTolerantStrategy with torchft's own DDP
  wrapper instead (``strategy.gradients = "ddp"``, what it used before); same model and batch; ms
  per step on group 0, medians over the blocks.

    python benchmarks/ft_recovery.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _strategy(args: argparse.Namespace) -> object:
    import towers
    from towers.cluster.info import ProcessInfo

    return towers.get_strategy("ft", info=ProcessInfo(rank=args.group, world_size=2), lighthouse=args.lighthouse,
                               peer_timeout_s=args.peer_timeout_s)


def _model_and_data(seed: int):
    import torch

    from towers.models import SeedCNN

    torch.manual_seed(seed)
    net = SeedCNN()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 2 * 8, 1, 28, 28, generator=g)
    return net, torch.utils.data.TensorDataset(x, torch.randint(0, 10, (len(x),), generator=g))


def _worker_recovery(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import towers

    strategy = _strategy(args)
    net, data = _model_and_data(args.seed)
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    batches = strategy.distribute_dataset(data, 128)

    def step(x, y):
        towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()
        optimizer.zero_grad()

    stop_at = None
    while stop_at is None or strategy.current_step < stop_at:
        for x, y in batches:
            strategy.run(step, args=(x, y))
            print(f"step {strategy.current_step} groups {strategy.num_replicas_in_sync} t {time.time():.4f}", flush=True)
            if stop_at is None and os.path.exists(args.stop_file):
                stop_at = int(Path(args.stop_file).read_text())
            if stop_at is not None and strategy.current_step >= stop_at:
                break
    torch.save(net.state_dict(), Path(args.stop_file).parent / f"group{args.group}.pt")
    strategy.shutdown()
    os._exit(0)


def _worker_steady(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    import towers
    from towers.cluster.info import ProcessInfo

    info = ProcessInfo(rank=args.group, world_size=2, local_rank=args.group, local_world_size=2,
                       master_addr="127.0.0.1", master_port=args.master_port)
    mirrored = towers.get_strategy("mirrored", info=info)
    ft = _strategy(args)
    engines = {}
    for name, strategy in (("mirrored", mirrored), ("ft", ft), ("ft_torchft_ddp", ft)):
        if name != "mirrored":
            strategy.gradients = "ddp" if name == "ft_torchft_ddp" else "flat"
        net, data = _model_and_data(0)
        model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
        engines[name] = (strategy, model, optimizer)
    g = torch.Generator().manual_seed(args.group)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)

    def run(name: str, steps: int) -> float:
        strategy, model, optimizer = engines[name]

        def step():
            loss = F.cross_entropy(model(x), y, reduction="none")
            towers.compute_average_loss(loss, global_batch_size=128).backward()
            optimizer.step()
            optimizer.zero_grad()

        mirrored.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            strategy.run(step)
        mirrored.barrier()
        return (time.perf_counter() - start) / steps * 1000

    for name in engines:  # warm-up
        run(name, 5)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            times[name].append(run(name, args.steps))
    if args.group == 0:
        print("RESULT " + json.dumps(times), flush=True)
    ft.shutdown()
    mirrored.shutdown()
    os._exit(0)


def _start(args: argparse.Namespace, mode: str, group: int, lighthouse: str, workdir: Path, seed: int,
           master_port: int = 0) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--worker", mode, "--group", str(group), "--lighthouse", lighthouse,
            "--stop-file", str(workdir / "stop"), "--seed", str(seed), "--peer-timeout-s", str(args.peer_timeout_s),
            "--master-port", str(master_port), "--repeats", str(args.repeats), "--steps", str(args.steps)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RUST_LOG="warn", OMP_NUM_THREADS="1")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)


def _steps(proc: subprocess.Popen):
    for line in proc.stdout:
        if line.startswith("step"):
            _, step, _, groups, _, t = line.split()
            yield int(step), int(groups), float(t)


def _recovery(args: argparse.Namespace, lighthouse: str) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        survivor = _start(args, "recovery", 0, lighthouse, workdir, seed=0)
        victim = _start(args, "recovery", 1, lighthouse, workdir, seed=1)
        try:
            victim_steps = _steps(victim)
            last = 0
            for last, _, _ in victim_steps:
                if last >= args.kill_after:
                    break
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.time()
            restarted = _start(args, "recovery", 1, lighthouse, workdir, seed=2)
            victim.wait()
            survivor_steps = _steps(survivor)
            for step, groups, t in survivor_steps:
                if t > killed and (groups == 1 or step >= last + 2):
                    next_step = t - killed
                    break
            back_step, _, back_t = next(_steps(restarted))
            tmp_stop = workdir / "stop.tmp"
            tmp_stop.write_text(str(back_step + 20))
            tmp_stop.replace(workdir / "stop")
            for proc in (survivor, restarted):
                for _ in proc.stdout:
                    pass
                proc.wait(timeout=120)
            a, b = (torch.load(workdir / f"group{g}.pt") for g in (0, 1))
            equal = all(torch.equal(a[k], b[k]) for k in a)
            return {"kill_to_survivor_step_s": next_step, "kill_to_back_in_quorum_s": back_t - killed,
                    "killed_after_step": last, "healed_at_step": back_step, "equal_parameters": equal}
        finally:
            for proc in (survivor, victim, locals().get("restarted")):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _steady(args: argparse.Namespace, lighthouse: str) -> dict:
    from towers.launch import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [_start(args, "steady", g, lighthouse, Path(tmp), seed=0, master_port=port) for g in (0, 1)]
        try:
            result = None
            for line in procs[0].stdout:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
            for proc in procs:
                proc.wait(timeout=120)
            return result or {}
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def main() -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft is imported: its lighthouse logs every quorum at INFO
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block (steady)")
    parser.add_argument("--kill-after", type=int, default=10, help="steps group 1 takes before it is killed")
    parser.add_argument("--peer-timeout-s", type=float, default=3.0)
    parser.add_argument("--skip-steady", action="store_true")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--worker", choices=("recovery", "steady"), help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        (_worker_recovery if args.worker == "recovery" else _worker_steady)(args)
        return

    from towers.strategies.fault_tolerant import start_lighthouse

    lighthouse = start_lighthouse("127.0.0.1", 0, peer_timeout_s=args.peer_timeout_s)
    print(f"load before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); peer_timeout_s={args.peer_timeout_s}")
    runs = [] if args.skip_recovery else [_recovery(args, lighthouse.address) for _ in range(args.repeats)]
    for r in runs:
        print("recovery:", json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))
    for key in ("kill_to_survivor_step_s", "kill_to_back_in_quorum_s") if runs else ():
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] over {len(values)}")
    if not args.skip_steady:
        times = _steady(args, lighthouse.address)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"steady ms/step (group 0, {args.repeats} blocks of {args.steps}): mirrored {med['mirrored']:.1f}, "
              f"ft {med['ft']:.1f}, ft with torchft's DDP {med['ft_torchft_ddp']:.1f}")
        for name in ("ft", "ft_torchft_ddp"):
            ratios = [f / m for f, m in zip(times[name], times["mirrored"])]
            print(f"  {name}/mirrored median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    lighthouse.shutdown()


if __name__ == "__main__":
    main()
