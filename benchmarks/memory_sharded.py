"""Per-rank memory and throughput: OneDevice vs Mirrored vs FullyShardedStrategy on a ~70M-parameter GPT.

For each configuration (strategy x processes) one spawned job builds ``GPT(GPTConfig.small())``
(69.5M parameters, no download) with AdamW, takes ``--warmup`` untimed and ``--steps`` timed
training steps on random tokens at a fixed per-replica batch (weak scaling), and every rank
reports:

- parameter, gradient and optimizer-state bytes it holds, counted from tensor storages
  (each storage once: DDP's gradient buckets and FSDP2's padded shards are counted as they are);
- its resident set size (RSS, from /proc): before the model was built (torch and the process
  group alone); the peak while building and preparing (each rank builds the full model before
  ``prepare`` shards it); after ``prepare``; the peak during the training steps (VmHWM reset
  after ``prepare``: activations, gathered units, optimizer temporaries, and memory the C
  allocator keeps after ``free``); and what the rank keeps after training once ``malloc_trim``
  has returned freed memory to the system (libraries, parameters, gradients, optimizer state);
- global examples/s over the timed steps.

Every configuration runs in freshly spawned processes with a fixed glibc mmap threshold
(``--mmap-threshold``, default 128 KiB): with glibc's default dynamic threshold, buffers of a
few MB that are freed stay in the heap, and RSS then counts memory no tensor holds — FSDP2,
which gathers and frees every unit's parameters each step, looked worse than it is (peak RSS
above Mirrored's). The fixed threshold has a price: every gathered buffer is a fresh mapping,
whose pages the kernel faults in and zeroes each step, which slowed the sharded step by ~50% on
this host. So memory is measured with it, and throughput with ``--mmap-threshold 0`` (glibc's
default).

``--checkpoint`` also times a sharded checkpoint of the trained model on every sharded
configuration: how long ``save_checkpoint`` blocks the training loop with ``async_save=False``
and ``True``, and how long the asynchronous write takes to finish.

    python benchmarks/memory_sharded.py --checkpoint     # memory + checkpoint cost, 1/2/4 processes (~4 min, 2 cores)
    python benchmarks/memory_sharded.py --mmap-threshold 0 --steps 4 \
        --configs one_device:1,mirrored:2,sharded:2,mirrored:2,sharded:2,mirrored:4,sharded:4   # throughput
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens

MB = 1024 * 1024


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _rss_mb(peak: bool) -> float:
    if peak:  # the high-water mark since the last _reset_peak() (or since the process started)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: give freed memory back, so RSS shows what is still held


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets the peak RSS (VmHWM) to the current RSS
        f.write("5")


def _job(name: str, options: dict, config: GPTConfig, batch: int, seq: int, warmup: int, steps: int,
         checkpoint_dir: str | None) -> dict:
    from towers.cluster.info import ProcessInfo

    baseline_mb = _rss_mb(peak=False)
    if name == "one_device":
        strategy = towers.OneDeviceStrategy("cpu", info=ProcessInfo())
    else:
        strategy = towers.get_strategy(name, timeout_s=600, **options)
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = strategy.prepare(model, optimizer)
    setup_peak_mb = _rss_mb(peak=True)  # includes the full model every rank builds before prepare shards it
    _trim()
    prepared_mb = _rss_mb(peak=False)
    _reset_peak()
    inputs, targets = random_tokens(batch * n * (warmup + steps), config, seed=1)
    data = (inputs[:, :seq], targets[:, :seq])

    def step(x, y):
        loss = towers.compute_average_loss(
            F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(len(x), -1).mean(dim=1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep gradients allocated: count them as a training step holds them
        return loss

    started = None
    for i, (x, y) in enumerate(strategy.distribute_dataset(data, batch * n, shuffle=False)):
        if i == warmup:
            strategy.barrier()
            started = time.perf_counter()
        strategy.run(step, args=(x, y))
    strategy.barrier()
    elapsed = time.perf_counter() - started
    peak_mb = _rss_mb(peak=True)
    _trim()
    params = list(model.parameters())
    result = {
        "params_mb": _storage_bytes(params) / MB,
        "grads_mb": _storage_bytes(p.grad for p in params) / MB,
        "optimizer_mb": _storage_bytes(v for s in optimizer.state.values() for v in s.values()
                                       if isinstance(v, torch.Tensor)) / MB,
        "baseline_rss_mb": baseline_mb,
        "setup_peak_rss_mb": setup_peak_mb,
        "prepared_rss_mb": prepared_mb,
        "peak_rss_mb": peak_mb,
        "kept_rss_mb": _rss_mb(peak=False),
        "examples_per_s": steps * batch * n / elapsed,
    }
    if checkpoint_dir is not None and name == "sharded":
        result["checkpoint"] = _time_checkpoints(strategy, model, optimizer, options, checkpoint_dir)
    strategy.shutdown()
    return result


def _time_checkpoints(strategy, model, optimizer, options, checkpoint_dir: str) -> dict:
    timings = {}
    for async_save in (False, True):
        saver = towers.FullyShardedStrategy(timeout_s=600, async_save=async_save, **options) if async_save else strategy
        # The same trained model and optimizer; only the writer differs (a second strategy object,
        # sharing the process group, with its own background-save group).
        path = os.path.join(checkpoint_dir, f"ckpt-async-{async_save}")
        state = strategy.state_dict(model, optimizer)
        saver.barrier()
        started = time.perf_counter()
        saver.save_checkpoint(path, state)
        blocking = time.perf_counter() - started
        saver.wait_for_checkpoint()
        timings[f"async={async_save}"] = {"blocking_s": blocking, "until_visible_s": time.perf_counter() - started}
    return timings


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print one table (and the checkpoint timings); return 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="one_device:1,mirrored:2,sharded:2,mirrored:4,sharded:4",
                   help="strategy:processes pairs (default: one_device:1,mirrored:2,sharded:2,mirrored:4,sharded:4)")
    p.add_argument("--batch", type=int, default=2, help="sequences per replica per step (default: 2)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128, at most the context)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--checkpoint", action="store_true", help="also time sharded checkpoints, sync and async")
    p.add_argument("--mmap-threshold", type=int, default=131072,
                   help="glibc MALLOC_MMAP_THRESHOLD_ for the ranks, in bytes (default: 131072; 0 = glibc's dynamic "
                        "threshold, which keeps freed large buffers in the heap and inflates peak RSS)")
    p.add_argument("--model", choices=("small", "tiny"), default="small",
                   help="small: the ~70M GPT (default); tiny: a 32k-parameter GPT to check the script quickly")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    config = GPTConfig.small() if args.model == "small" else GPTConfig.tiny()
    if args.mmap_threshold:  # glibc reads it when a process starts: set here, the spawned ranks inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.configs.split(","):
            name, _, count = item.partition(":")
            nprocs = int(count or 1)
            threads = max(1, cores // nprocs)
            job_args = (name, {"shard_units": "auto"} if name == "sharded" else {}, config, args.batch, args.seq,
                        args.warmup, args.steps, os.path.join(tmp, item.replace(":", "-")) if args.checkpoint else None)
            print(f"running {name} on {nprocs} process(es), {threads} thread(s) each ...", file=sys.stderr)
            per_rank = towers.spawn(_job, nprocs, args=job_args, timeout_s=1800, threads_per_process=threads)
            rows.append({"strategy": name, "processes": nprocs, "per_rank": per_rank})
    total = GPT(config).num_parameters()
    print(f"GPT {total / 1e6:.1f}M parameters, AdamW, per-replica batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} timed steps; torch {torch.__version__}, {cores} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'dynamic'}")
    print()
    print("MB per rank (the largest rank's value for the p+g+o and RSS columns):")
    print()
    print("| strategy | processes | params | grads | optimizer | p+g+o | "
          "RSS before model | peak RSS, build+prepare | RSS after prepare | peak RSS, training | "
          "RSS kept after training | examples/s (global) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        r0 = row["per_rank"][0]
        pgo = max(r["params_mb"] + r["grads_mb"] + r["optimizer_mb"] for r in row["per_rank"])
        worst = {k: max(r[k] for r in row["per_rank"]) for k in
                 ("baseline_rss_mb", "setup_peak_rss_mb", "prepared_rss_mb", "peak_rss_mb", "kept_rss_mb")}
        print(f"| {row['strategy']} | {row['processes']} | {r0['params_mb']:.0f} | {r0['grads_mb']:.0f} | "
              f"{r0['optimizer_mb']:.0f} | {pgo:.0f} | {worst['baseline_rss_mb']:.0f} | "
              f"{worst['setup_peak_rss_mb']:.0f} | {worst['prepared_rss_mb']:.0f} | {worst['peak_rss_mb']:.0f} | "
              f"{worst['kept_rss_mb']:.0f} | {r0['examples_per_s']:.2f} |")
    for row in rows:
        if "checkpoint" in row["per_rank"][0]:
            timings = row["per_rank"][0]["checkpoint"]
            print(f"checkpoint, sharded on {row['processes']}: " + "; ".join(
                f"{k}: blocks {v['blocking_s']:.2f} s, visible after {v['until_visible_s']:.2f} s"
                for k, v in timings.items()))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
