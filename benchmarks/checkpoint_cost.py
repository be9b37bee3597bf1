"""What a checkpoint costs: save and restore time, peak memory, async blocking, and the preemption latency.

For each configuration (strategy:processes) one spawned job builds ``GPT(GPTConfig.small())``
(69.5M parameters, no download) with AdamW, takes one training step (so every Adam moment
exists), then, on every rank:

- **save**: ``towers.checkpoint.save_checkpoint(path, {"model", "optimizer", "step"})``, the seconds
  until it returns (published: every rank's part written, fsynced, the link replaced), and the peak
  RSS it added above the RSS before it (VmHWM reset just before);
- **async save** (sharded, ``async_save=True``): the seconds the training loop is blocked, and
  until the checkpoint is visible;
- **restore**: a fresh model and optimizer, ``restore_checkpoint`` into them (resharding where
  needed), its seconds and the peak RSS it added;
- **preemption**: rank 1 sends itself SIGTERM at a step boundary; every rank checks
  ``PreemptionHandler.should_save`` at each boundary, takes the agreed next step, saves; the
  chief reports signal -> checkpoint published, and the step time inside it.

    python benchmarks/checkpoint_cost.py                              # mirrored:2, sharded:2, sharded:4 (~3 min, 2 cores)
    python benchmarks/checkpoint_cost.py --configs mirrored:2 --repeats 3

The checkpoint directory is a fresh temporary folder on the local disk (``--dir`` to choose).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import towers
from towers.checkpoint import PreemptionHandler, restore_checkpoint, save_checkpoint
from towers.models_gpt import GPT, GPTConfig, random_tokens

MB = 1024 * 1024


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def _strategy(name: str, async_save: bool = False) -> towers.Strategy:
    if name == "mirrored":
        return towers.MirroredStrategy(timeout_s=600)
    return towers.FullyShardedStrategy(timeout_s=600, async_save=async_save)


def _build(strategy: towers.Strategy):
    config = GPTConfig.small()
    with strategy.scope():
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = random_tokens(2 * strategy.num_replicas_in_sync, config, seed=1)
    batches = strategy.distribute_dataset((x, y), 2 * strategy.num_replicas_in_sync, shuffle=False)

    def step() -> float:
        started = time.perf_counter()
        for xb, yb in batches:
            def fn(xb, yb):
                loss = towers.compute_average_loss(
                    F.cross_entropy(model(xb).transpose(1, 2), yb, reduction="none").mean(dim=1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            strategy.run(fn, args=(xb, yb))
        return time.perf_counter() - started

    return model, optimizer, step


def _timed(fn) -> tuple[float, int]:
    """Seconds ``fn`` took on this rank and the peak RSS it added (bytes), after every rank started together."""
    before = _rss("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started, max(0, _rss("VmHWM") - before)


def _job(name: str, folder: str, repeats: int) -> dict:
    strategy = _strategy(name)
    model, optimizer, step = _build(strategy)
    step()  # every Adam moment exists now
    out: dict = {"save_s": [], "save_peak_mb": [], "restore_s": [], "restore_peak_mb": []}
    for r in range(repeats):
        path = os.path.join(folder, f"{name}-{r}")
        strategy.barrier()
        s, peak = _timed(functools.partial(save_checkpoint, path, {"model": model, "optimizer": optimizer, "step": 1},
                                           strategy=strategy))
        out["save_s"].append(s)
        out["save_peak_mb"].append(peak / MB)
        fresh_model, fresh_optimizer, _ = _build(strategy)
        strategy.barrier()
        s, peak = _timed(functools.partial(restore_checkpoint, path,
                                           {"model": fresh_model, "optimizer": fresh_optimizer}, strategy=strategy))
        out["restore_s"].append(s)
        out["restore_peak_mb"].append(peak / MB)
        del fresh_model, fresh_optimizer
    if name == "sharded":
        saver = _strategy(name, async_save=True)  # the same process group, a background-save group of its own
        out["async_blocking_s"], out["async_visible_s"] = [], []
        for r in range(repeats):
            path = os.path.join(folder, f"{name}-async-{r}")
            saver.barrier()
            started = time.perf_counter()
            saver.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": 1})
            out["async_blocking_s"].append(time.perf_counter() - started)
            saver.wait_for_checkpoint()
            out["async_visible_s"].append(time.perf_counter() - started)
    # Preemption: rank 1 is signalled at boundary 1; every rank saves at the agreed step.
    handler = PreemptionHandler(rank=strategy.process_info.rank).install()
    out["preempt_s"], out["preempt_step_s"] = [], []
    for r in range(repeats):
        handler = PreemptionHandler(rank=strategy.process_info.rank).install() if r else handler
        strategy.barrier()
        signalled = None
        if strategy.replica_id == 1:
            signalled = time.time()
            os.kill(os.getpid(), signal.SIGTERM)
        signalled = strategy.broadcast_object(signalled, src=1) if strategy.num_replicas_in_sync > 1 else signalled
        done, steps = 1, []
        while not handler.should_save(done):
            steps.append(step())
            done += 1
        save_checkpoint(os.path.join(folder, f"{name}-preempted-{r}"), {"model": model, "optimizer": optimizer,
                                                                          "step": done}, strategy=strategy)
        out["preempt_s"].append(time.time() - signalled)
        out["preempt_step_s"].append(sum(steps))
        handler.uninstall()
        _clear_notice(strategy)
    strategy.shutdown()
    return out


def _clear_notice(strategy) -> None:
    # The next repeat needs a fresh notice and decision: the chief removes them from the store.
    strategy.barrier()
    if strategy.is_chief:
        from towers.checkpoint.preemption import _DECISION, _NOTICE, _default_store

        store = _default_store()
        for key in (_NOTICE, _DECISION):
            store.delete_key(key)
    strategy.barrier()


def main(argv: list[str] | None = None) -> int:
    """Run every configuration and print one table; return 0."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="mirrored:2,sharded:2,sharded:4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for item in args.configs.split(","):
            name, n = item.split(":")
            folder = os.path.join(tmp, item.replace(":", "-"))
            os.makedirs(folder)
            results = towers.spawn(_job, int(n), args=(name, folder, args.repeats), timeout_s=1800,
                                   threads_per_process=max(1, (os.cpu_count() or 2) // int(n)))
            rows.append({"config": item, "per_rank": results})
    med = statistics.median
    print(f"{'config':<12} {'save s':>8} {'peak MB/rank':>13} {'restore s':>10} {'peak MB/rank':>13} "
          f"{'async blocks s':>15} {'visible s':>10} {'signal->saved s':>16} {'(its step s)':>13}")
    for row in rows:
        ranks = row["per_rank"]
        chief = ranks[0]
        peak_save = max(med(r["save_peak_mb"]) for r in ranks)
        peak_restore = max(med(r["restore_peak_mb"]) for r in ranks)
        print(f"{row['config']:<12} {med(chief['save_s']):>8.2f} {peak_save:>13.0f} {med(chief['restore_s']):>10.2f} "
              f"{peak_restore:>13.0f} "
              f"{med(chief['async_blocking_s']) if 'async_blocking_s' in chief else float('nan'):>15.3f} "
              f"{med(chief['async_visible_s']) if 'async_visible_s' in chief else float('nan'):>10.2f} "
              f"{med(chief['preempt_s']):>16.2f} {med(chief['preempt_step_s']):>13.2f}")
    ranges = {r["config"]: [round(min(r["per_rank"][0]["save_s"]), 2), round(max(r["per_rank"][0]["save_s"]), 2)]
              for r in rows}
    print(f"(median of {args.repeats}; save/restore: the chief's seconds; peak: the largest rank's added RSS; "
          f"save ranges: {json.dumps(ranges)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
