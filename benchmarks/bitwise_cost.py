"""What ``bitwise=True`` costs: step time with and without it, at 2 and 4 replicas: the seed CNN on the digits
(global batch 48, Adam) or towers' 69.5M GPT (``GPTConfig.small()``, AdamW, ``--gpt-batch`` sequences of
``--gpt-tokens`` tokens), under MirroredStrategy, FullyShardedStrategy (``--strategy sharded``) or sync parameter
servers (``--strategy ps``: one more process, the ps task; no clip there, in both modes).

One ``towers.spawn`` job per (replicas, mode), the modes interleaved and each pair repeated; each job times its
steps after a warm-up and reports the median step. Both modes train the same global batch; bitwise cuts it into
micro-batches of ``--micro-batch`` examples. The bytes each replica sends per step are counted from the model's
size: DDP's ring all-reduce sends ``2 (N-1)/N`` gradients; the tree sends the other replicas their chunks of this
replica's ``w`` subtrees (padded to the same count on every replica) in one all-to-all, then its chunk of the sum in
an all-gather: ``(w + 1) (N-1)/N`` (sharded: the all-to-all alone, in place of FSDP2's reduce-scatter). Under the
parameter servers a worker pushes its gradient (plain) or its ``w`` subtrees (bitwise) and pulls the parameters.

    python benchmarks/bitwise_cost.py                           # CNN, 2 and 4 replicas, 3 repeats
    python benchmarks/bitwise_cost.py --replicas 2 --repeats 5 --micro-batch 12
    python benchmarks/bitwise_cost.py --model gpt --micro-batch 2 --steps 4 --warmup 1

Results go in BENCHMARKS.md ("Bit for bit: what it costs").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import towers  # noqa: E402
from bitwise_job import classifier_step  # noqa: E402
from towers.datasets import load_digits  # noqa: E402
from towers.models import SeedCNN  # noqa: E402

GLOBAL_BATCH = 48


def job(bitwise: bool, micro_batch: int, steps: int, warmup: int, model_name: str = "cnn", strategy_name: str = "mirrored",
        gpt_batch: int = 8, gpt_tokens: int = 64) -> float:
    """Median seconds per step of this process's loop."""
    micro = micro_batch if bitwise else None
    if strategy_name == "ps":  # the last process is the ps task: it serves, then reports nothing
        strategy: Any = towers.ParameterServerStrategy(num_ps=1, mode="sync", bitwise=bitwise, micro_batch_size=micro,
                                                       exit_on_ps=False)
        if strategy.is_ps:
            return 0.0
    else:
        kind = towers.FullyShardedStrategy if strategy_name == "sharded" else towers.MirroredStrategy
        strategy = kind(bitwise=bitwise, micro_batch_size=micro)
    clip = strategy_name != "ps"  # the parameter servers refuse a global-norm clip
    torch.manual_seed(0)
    if model_name == "gpt":
        from torch.utils.data import TensorDataset

        from towers.models_gpt import GPT, GPTConfig, random_tokens

        config = GPTConfig(block_size=gpt_tokens)
        train_set, global_batch = TensorDataset(*random_tokens(gpt_batch * (steps + warmup), config)), gpt_batch
        net: torch.nn.Module = GPT(config)
        model, optimizer = strategy.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
        step = gpt_step(strategy, model, optimizer, clip)
    else:
        train_set, _ = load_digits()
        global_batch, net = GLOBAL_BATCH, SeedCNN()
        model, optimizer = strategy.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-3))
        step = classifier_step(strategy, model, optimizer, clip="towers" if clip else "none")  # the tests' step
    times: list[float] = []
    batches = strategy.distribute_dataset(train_set, global_batch, shuffle=True, drop_remainder=True)
    while len(times) < steps + warmup:
        for batch in batches:
            start = time.perf_counter()
            strategy.reduce("sum", strategy.run(step, args=tuple(batch))).item()
            times.append(time.perf_counter() - start)
            if len(times) == steps + warmup:
                break
    strategy.shutdown()
    return statistics.median(times[warmup:])


def gpt_step(strategy: towers.Strategy, model: torch.nn.Module, optimizer: Any, clip: bool = True) -> Any:
    """A nanoGPT-style step: the mean token cross entropy of the global batch, backward, towers' clip, AdamW."""
    import torch.nn.functional as F

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        per_token = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="none")
        loss = towers.compute_average_loss(per_token.view_as(targets).mean(dim=1))
        loss.backward()
        if clip:
            strategy.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    return step


def wire_bytes(replicas: int, micro_batch: int, global_batch: int, n: int, ps: bool = False) -> dict[str, float]:
    """Bytes one replica sends per step for ``n`` bytes of gradient: DDP's ring all-reduce vs the tree's exchange
    (``ps``: a worker's push, its gradient or its subtrees)."""
    from towers.strategies._bitwise_tree import dyadic_nodes

    per = global_batch // micro_batch // replicas
    width = max(len(dyadic_nodes(r * per, (r + 1) * per)) for r in range(replicas))
    if ps:
        return {"ddp": float(n), "bitwise": float(width * n)}
    # bitwise: an all-to-all of every subtree's (N-1)/N foreign chunks, then an all-gather of the sum's chunk
    return {"ddp": 2 * (replicas - 1) / replicas * n, "bitwise": (width + 1) * (replicas - 1) / replicas * n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    parser.add_argument("--strategy", choices=("mirrored", "sharded", "ps"), default="mirrored")
    parser.add_argument("--gpt-batch", type=int, default=8, help="sequences per global batch (--model gpt)")
    parser.add_argument("--gpt-tokens", type=int, default=64, help="tokens per sequence (--model gpt)")
    args = parser.parse_args(argv)
    if args.model == "gpt":
        from towers.models_gpt import GPT, GPTConfig

        global_batch, size = args.gpt_batch, GPT(GPTConfig(block_size=args.gpt_tokens)).num_parameters() * 4
        what = f"GPT {size / 4e6:.1f}M, {global_batch} x {args.gpt_tokens} tokens, AdamW"
    else:
        global_batch, size = GLOBAL_BATCH, sum(p.numel() for p in SeedCNN().parameters()) * 4
        what = f"seed CNN, global batch {GLOBAL_BATCH}, Adam"
    print(f"{what}, {args.strategy}, micro_batch_size={args.micro_batch}; median step (s) of {args.steps} after "
          f"{args.warmup}, median of {args.repeats} interleaved repeats")
    for n in args.replicas:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for bitwise in (False, True):  # interleaved: a slow moment of the machine hits both
                job_args = (bitwise, args.micro_batch, args.steps, args.warmup, args.model, args.strategy,
                            args.gpt_batch, args.gpt_tokens)
                per_rank = towers.spawn(job, n + (args.strategy == "ps"), args=job_args, timeout_s=900,
                                        threads_per_process=1)
                runs[bitwise].append(max(per_rank))
        plain, exact = statistics.median(runs[False]), statistics.median(runs[True])
        wire = wire_bytes(n, args.micro_batch, global_batch, size, ps=args.strategy == "ps")
        print(f"{n} replicas: plain {plain * 1e3:.1f} ms, bitwise {exact * 1e3:.1f} ms, ratio {exact / plain:.2f}x; "
              f"bytes sent per replica per step: {'push' if args.strategy == 'ps' else 'DDP'} "
              f"{wire['ddp'] / 2**20:.2f} MiB, bitwise "
              f"{wire['bitwise'] / 2**20:.2f} MiB ({wire['bitwise'] / wire['ddp']:.1f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
