"""Loader workers: towers (``num_workers=2``) vs hand-written DDP + ``DataLoader(num_workers=2)``, and vs no workers.

A map-style dataset with a real per-example cost: ``__getitem__`` reads one ``.npy`` file (a 48x48
uint8 image) from a temporary directory, waits ``--wait-ms`` (storage latency: a network disk, an
object store; 0 for a local SSD) and does ``--cpu-ms`` of numpy work (FFT round trips, the stand-in
for decoding), then crops to [1, 28, 28] float32. Seed CNN, SGD, mean cross-entropy, 2 processes
(``towers.spawn``, one torch thread each), per-replica batch ``--batch-size``. In the same
processes, each repeat times ``--steps`` steps of each engine, in a rotating order:

* ``towers_w2``: MirroredStrategy, ``distribute_dataset(..., num_workers=2, persistent_workers=True)``;
* ``ddp_w2``: ``DistributedDataParallel`` + ``DataLoader(DistributedSampler, num_workers=2,
  persistent_workers=True, pin_memory=<CUDA available>)``;
* ``towers_w0``: MirroredStrategy, ``distribute_dataset(...)`` (the in-process fetch).

A step's time is taken between the ends of consecutive steps (the first batch of a pass, with the
workers' start, is out). Reported: examples/s (global) per engine, median and range over repeats,
and the medians of the per-repeat ratios towers_w2/ddp_w2 and towers_w2/towers_w0.

    python benchmarks/loader_workers.py                        # 5 repeats x 25 steps (~1.5 min on 2 cores)
    python benchmarks/loader_workers.py --wait-ms 0 --cpu-ms 1  # all CPU: on 2 cores, workers cannot add cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import towers
from towers.models import SeedCNN

ENGINES = ("towers_w2", "ddp_w2", "towers_w0")


def _work(image: np.ndarray, rounds: int) -> np.ndarray:
    """The numpy work of one decode: ``rounds`` FFT round trips of the image."""
    x = image.astype(np.float32) / 255.0
    for _ in range(rounds):
        x = np.fft.irfft2(np.fft.rfft2(x) * 0.999, s=x.shape).astype(np.float32)
    return x


class DecodedImages(Dataset):
    """Files ``<dir>/<i>.npy``: read, wait ``wait_ms``, ``rounds`` of numpy work, crop to [1, 28, 28]."""

    def __init__(self, directory: str, size: int, wait_ms: float, rounds: int):
        self.directory, self.size, self.wait_s, self.rounds = directory, size, wait_ms / 1000.0, rounds

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = np.load(os.path.join(self.directory, f"{i}.npy"))
        if self.wait_s:
            time.sleep(self.wait_s)
        x = _work(image, self.rounds)[10:38, 10:38]
        return torch.from_numpy(np.ascontiguousarray(x)).unsqueeze(0), torch.tensor(i % 10)


def _write_files(directory: str, size: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(size):
        np.save(os.path.join(directory, f"{i}.npy"), rng.integers(0, 256, (48, 48), dtype=np.uint8))


def _calibrate(cpu_ms: float) -> tuple[int, float]:
    """Return the FFT rounds that take about ``cpu_ms`` here, and the measured ms per example."""
    image = np.random.default_rng(1).integers(0, 256, (48, 48), dtype=np.uint8)
    _work(image, 50)
    t = time.process_time()
    _work(image, 200)
    per_round = (time.process_time() - t) / 200 * 1000.0
    rounds = max(0, round(cpu_ms / per_round)) if cpu_ms > 0 else 0
    return rounds, rounds * per_round


def _job(directory: str, size: int, wait_ms: float, rounds: int, steps: int, repeats: int, batch_size: int) -> dict:
    torch.set_num_threads(1)
    strategy = towers.strategy_from_env()
    n, rank = strategy.num_replicas_in_sync, strategy.replica_id
    dataset = DecodedImages(directory, size, wait_ms, rounds)
    global_batch = batch_size * n

    with strategy.scope():
        torch.manual_seed(0)
        net = SeedCNN()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    model, opt = strategy.prepare(net, optimizer)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()

    torch.manual_seed(0)
    raw = torch.nn.parallel.DistributedDataParallel(SeedCNN())
    raw_opt = torch.optim.SGD(raw.parameters(), lr=0.01)
    sampler = DistributedSampler(dataset, num_replicas=n, rank=rank, shuffle=True, seed=0, drop_last=True)
    raw_loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=2, persistent_workers=True,
                            pin_memory=torch.cuda.is_available(), drop_last=True)
    inputs = {
        "towers_w2": strategy.distribute_dataset(dataset, global_batch, seed=0, drop_remainder=True, num_workers=2,
                                                 persistent_workers=True),
        "towers_w0": strategy.distribute_dataset(dataset, global_batch, seed=0, drop_remainder=True),
    }
    epochs = dict.fromkeys(ENGINES, 0)

    def timed(engine: str) -> float:
        """Seconds per step over ``steps`` steps, between the ends of consecutive steps."""
        times = []
        if engine == "ddp_w2":
            sampler.set_epoch(epochs[engine])
            for x, y in raw_loader:
                loss = F.cross_entropy(raw(x), y)
                loss.backward()
                raw_opt.step()
                raw_opt.zero_grad()
                times.append(time.perf_counter())
                if len(times) == steps + 1:
                    break
        else:
            batches = inputs[engine]
            batches.set_epoch(epochs[engine])
            for x, y in batches:
                strategy.run(step, args=(x, y))
                times.append(time.perf_counter())
                if len(times) == steps + 1:
                    break
        epochs[engine] += 1
        if len(times) < steps + 1:
            raise RuntimeError(f"{engine}: the dataset has fewer than {steps + 1} steps per epoch")
        return (times[-1] - times[0]) / steps

    for engine in ENGINES:  # warm-up: start the persistent workers, first-step allocations
        timed(engine)
    rows = []
    for r in range(repeats):
        order = ENGINES[r % 3:] + ENGINES[:r % 3]
        row = {}
        for engine in order:
            strategy.barrier()
            row[engine] = global_batch / timed(engine)
        rows.append(row)
    inputs["towers_w2"].close()
    return {"rows": rows, "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison on 2 processes and print a table and the ratios (and JSON with --json-out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=25, help="timed steps per engine and repeat (default: 25)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default: 5)")
    p.add_argument("--batch-size", type=int, default=32, help="per-replica batch (default: 32)")
    p.add_argument("--cpu-ms", type=float, default=0.5, help="numpy work per example, ms (default: 0.5)")
    p.add_argument("--wait-ms", type=float, default=1.0, help="storage latency per example, ms (default: 1.0)")
    p.add_argument("--json-out", default=None, help="also write the results here")
    args = p.parse_args(argv)
    nprocs = 2
    size = args.batch_size * nprocs * (args.steps + 2)  # one pass covers a repeat's steps
    rounds, cpu_ms = _calibrate(args.cpu_ms)
    print(f"per example: read a 48x48 .npy, wait {args.wait_ms} ms, {cpu_ms:.2f} ms of numpy work ({rounds} FFT "
          f"rounds); {size} files; {nprocs} processes x batch {args.batch_size}; {args.repeats} repeats x "
          f"{args.steps} steps; load before {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    with tempfile.TemporaryDirectory(prefix="towers-loader-bench-") as directory:
        _write_files(directory, size)
        per_rank = towers.spawn(_job, nprocs, args=(directory, size, args.wait_ms, rounds, args.steps, args.repeats,
                                                    args.batch_size),
                                timeout_s=900, threads_per_process=1,
                                env={"TOWERS_STRATEGY": "mirrored", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    rows = per_rank[0]["rows"]
    print(f"\n{'engine':<10} {'examples/s':>10} {'[min-max]':>15}")
    print(f"{'-' * 10} {'-' * 10} {'-' * 15}")
    summary: dict = {"args": vars(args), "cpu_ms_measured": cpu_ms, "rows": rows}
    for engine in ENGINES:
        values = [r[engine] for r in rows]
        summary[engine] = statistics.median(values)
        print(f"{engine:<10} {statistics.median(values):>10,.0f} {f'[{min(values):,.0f}-{max(values):,.0f}]':>15}")
    for a, b in (("towers_w2", "ddp_w2"), ("towers_w2", "towers_w0")):
        ratios = [r[a] / r[b] for r in rows]
        summary[f"{a}/{b}"] = statistics.median(ratios)
        print(f"{a} / {b}: {statistics.median(ratios):.3f} (per-repeat {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"load after {os.getloadavg()[0]:.2f}; a shared 2-core machine: wall-time numbers move by +-20%")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
