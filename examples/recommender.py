"""A click-through-rate model whose embedding table lives on parameter servers (HybridStrategy).

Synthetic clicks with a known ground truth: each example has ``--fields`` categorical features
(ids drawn log-uniformly from ``--vocab`` values per field: a few very frequent, a long tail);
the true click logit is a sum of one hidden weight per (field, id) plus a rank-4 interaction of
the first two fields (hidden vectors per id, a factorisation machine's), and the label is drawn
from it. The oracle AUC (ranking by the true logit) is printed beside the model's, so AUC means
something.

The click log is a file set: ``--shards`` files of fixed-size binary records (ids, click) in
``--data-dir`` (default: a directory under the system's temp dir, reused by later runs with the
same data), streamed with ``towers.data.Shards`` and a reader: every worker reads the records,
keeps its share of each global batch, and the shard order and a block of each shard are
shuffled per epoch (see docs/streams.md).

The model: one hashed ``towers.ShardedEmbedding`` table of ``--rows`` rows shared by all fields
(id ``v`` of field ``f`` hashes ``f * 2**40 + v``; distinct keys may collide), the fields'
embeddings and their pairwise dot products (DLRM's interaction) fed to an MLP. Under
``HybridStrategy`` the rows live on the ps tasks (row-wise Adagrad there) and the MLP is
all-reduced among the workers; ``Trainer.fit`` runs it, one script for all.

    # THE command: 2 workers + 1 ps task on this host (self-contained: towers.spawn); 2 epochs of 1M clicks,
    # AUC within 0.03 of the oracle (0.764 vs 0.780 in 144 s on a busy 2-core host); the last line says so
    python examples/recommender.py --workers 2 --num-ps 1
    # the same under the launcher
    towers launch --strategy hybrid --num-ps 1 --nproc-per-node 3 examples/recommender.py
    # the reference: one process, a plain nn.Embedding of the same rows, same optimizer (sparse Adagrad)
    python examples/recommender.py --strategy one_device
    # the table replicated on every worker and all-reduced (MirroredStrategy): each step all-reduces
    # and updates the whole table, so use a small one
    python examples/recommender.py --strategy mirrored --workers 2 --rows 65536
    # a table 4x larger than a worker may use: 120M rows x 16 (7.2 GiB) with workers limited to 1.5 GiB
    python examples/recommender.py --workers 2 --num-ps 1 --rows 120000000 --worker-memory-gib 1.5
    # a long tail the log cannot teach: 200,000 ids per field, most seen once or never in 1M clicks
    python examples/recommender.py --workers 2 --num-ps 1 --vocab 200000

Prints (and with ``--json PATH`` writes) AUC, oracle AUC, examples/s, each worker's peak RSS,
bytes on the ps links per step vs the touched-rows ideal, and the rows the ps tasks hold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.data import Shards


@dataclass
class Config:
    strategy: str = "hybrid"
    workers: int = 2
    num_ps: int = 1
    mode: str = "sync"
    rows: int = 1 << 20
    dim: int = 16
    fields: int = 8
    vocab: int = 1000
    train_examples: int = 1 << 20
    eval_examples: int = 32_768
    shards: int = 8
    data_dir: str = ""
    epochs: int = 2
    batch: int = 1024
    lr: float = 0.05
    seed: int = 0
    worker_memory_gib: float = 0.0
    threads: int = 1


# --- data with a known ground truth -------------------------------------------------------------------
RANK = 4  # of the hidden interaction between the first two fields


def _hidden(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """A fixed pseudo-random weight in [-1, 1] per key (no table: any vocabulary size works)."""
    return towers.ShardedEmbedding.hash(keys, 2_000_001, seed=salt).to(torch.float32) / 1_000_000.0 - 1.0


def field_keys(ids: torch.Tensor) -> torch.Tensor:
    """Return the table keys of ``ids [n, fields]``: id ``v`` of field ``f`` is ``f * 2**40 + v``."""
    return ids.long() + (torch.arange(ids.shape[-1], dtype=torch.int64) << 40)


def make_data(n: int, cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(ids [n, fields] int32, clicks [n] float, true logits [n])``."""
    g = torch.Generator().manual_seed(seed)
    ids = (cfg.vocab ** torch.rand(n, cfg.fields, generator=g, dtype=torch.float64)).long() - 1
    keys = field_keys(ids)
    # One weight per (field, id), plus a rank-4 interaction of the first two fields (a factorisation machine's).
    u = torch.stack([_hidden(keys[:, 0] * 64 + j, 3) for j in range(RANK)], 1)
    v = torch.stack([_hidden(keys[:, 1] * 64 + j, 4) for j in range(RANK)], 1)
    logit = 1.5 * _hidden(keys, 1).sum(1) / math.sqrt(cfg.fields) + 1.5 * math.sqrt(3 / RANK) * (u * v).sum(1) - 1.0
    clicks = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return ids.int(), clicks, logit


# --- the click log: shards of fixed-size binary records, streamed with towers.data.Shards -------------------
def record_dtype(fields: int) -> np.dtype:
    """One click: the ids of every field (int32) and the click (float32)."""
    return np.dtype([("ids", "<i4", (fields,)), ("click", "<f4")])


def write_click_log(cfg: Config) -> list[str]:
    """Write the training clicks as ``cfg.shards`` files (once: a later run with the same data reuses them); return them.

    Every process may call it: a shard is written to a temporary name and renamed, and its
    content depends only on the config, so concurrent writers produce the same file.
    """
    digest = hashlib.sha1(repr((cfg.fields, cfg.vocab, cfg.train_examples, cfg.shards, cfg.seed)).encode()).hexdigest()
    root = Path(cfg.data_dir or Path(tempfile.gettempdir()) / "towers-recommender") / digest[:12]
    root.mkdir(parents=True, exist_ok=True)
    bounds = [cfg.train_examples * s // cfg.shards for s in range(cfg.shards + 1)]
    paths = []
    for s in range(cfg.shards):
        path = root / f"clicks-{s:05d}-of-{cfg.shards:05d}.bin"
        if not path.exists():
            ids, clicks, _ = make_data(bounds[s + 1] - bounds[s], cfg, seed=1000 * (cfg.seed + 1) + s)
            records = np.empty(len(clicks), dtype=record_dtype(cfg.fields))
            records["ids"], records["click"] = ids.numpy(), clicks.numpy()
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            records.tofile(tmp)
            os.replace(tmp, path)
        paths.append(str(path))
    return paths


class ReadClicks:
    """The reader of one shard: yields ``(ids, click)`` records from ``start`` on (a resumed epoch seeks)."""

    def __init__(self, fields: int):
        self.dtype = record_dtype(fields)

    def __call__(self, path: str, start: int = 0) -> Iterator[tuple[np.ndarray, np.float32]]:
        records = np.fromfile(path, dtype=self.dtype, offset=start * self.dtype.itemsize)
        return zip(records["ids"], records["click"])


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties averaged)."""
    scores, labels = scores.double().reshape(-1), labels.reshape(-1).bool()
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    uniq, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    if uniq.numel() < scores.numel():  # average the ranks of ties
        sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
        ranks = (sums / counts)[inverse]
    pos, neg = int(labels.sum()), int((~labels).sum())
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


# --- the model ------------------------------------------------------------------------------------
class PlainHashedEmbedding(nn.Module):
    """The same hashed table as a plain ``nn.Embedding`` (one process, or replicated under Mirrored).

    ``sparse=True`` (one process): Adagrad then updates only the looked-up rows, the same maths
    as dense Adagrad (a zero gradient leaves a row and its slot unchanged), without a pass over
    the whole table every step.
    """

    def __init__(self, rows: int, dim: int, seed: int, sparse: bool = False):
        super().__init__()
        self.rows, self.seed = rows, seed
        self.table = nn.Embedding(rows, dim, sparse=sparse,
                                  _weight=towers.ShardedEmbedding(rows, dim, seed=seed).initial_weight())

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.table(towers.ShardedEmbedding.hash(keys, self.rows, seed=self.seed))


class CTRModel(nn.Module):
    """Embeddings of every field and their pairwise dot products (DLRM's interaction), then an MLP: one logit each."""

    def __init__(self, table: nn.Module, fields: int, dim: int):
        super().__init__()
        self.table = table
        self.register_buffer("pairs", torch.triu_indices(fields, fields, 1), persistent=False)
        width = fields * dim + self.pairs.shape[1]
        self.mlp = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.table(field_keys(ids))  # [n, fields, dim]
        dots = torch.bmm(e, e.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.mlp(torch.cat([e.flatten(1), dots], 1)).squeeze(-1)


def build(cfg: Config, sharded: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return the model and its optimizer (Adagrad everywhere: row-wise on the ps equals dense Adagrad)."""
    torch.manual_seed(cfg.seed)
    if sharded:
        table: nn.Module = towers.ShardedEmbedding(cfg.rows, cfg.dim, mode="none", hashed=True, optimizer="adagrad",
                                                    lr=cfg.lr, seed=cfg.seed)
    else:
        table = PlainHashedEmbedding(cfg.rows, cfg.dim, cfg.seed, sparse=cfg.strategy == "one_device")
    model = CTRModel(table, cfg.fields, cfg.dim)
    return model, torch.optim.Adagrad(model.parameters(), lr=cfg.lr)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(cfg: Config) -> dict:
    """Train ``cfg.epochs`` passes over the click log, evaluate; return this process's measurements (or a ps task's)."""
    torch.set_num_threads(cfg.threads)
    # One process: the plain table's gradient is sparse; torch warns that it skips checking such tensors.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    sharded = cfg.strategy in ("hybrid", "ps")
    options = {"mode": cfg.mode, "exit_on_ps": False} if sharded else {}
    strategy = towers.strategy_from_env(**options) if cfg.strategy != "one_device" else \
        towers.OneDeviceStrategy("cpu")
    if getattr(strategy, "is_ps", False):
        stats = strategy.ps_stats()[0]
        return {"role": "ps", "peak_rss_mb": _peak_rss_mb(), "tables": stats["embeddings"]["tables"]}
    if cfg.worker_memory_gib:
        limit = int(cfg.worker_memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    plain_table_fits = None
    if cfg.worker_memory_gib:  # show that the table itself could not live in this worker
        try:
            del_me = torch.empty(cfg.rows, cfg.dim)
            plain_table_fits = True
            del del_me
        except (RuntimeError, MemoryError):
            plain_table_fits = False
    model, optimizer = build(cfg, sharded)
    trainer = towers.Trainer(model, optimizer, loss=F.binary_cross_entropy_with_logits, strategy=strategy,
                             log_every_n_steps=20)
    clicks = Shards(write_click_log(cfg), ReadClicks(cfg.fields))
    before = strategy.wire_stats() if sharded else {}
    start = time.perf_counter()
    history = trainer.fit(clicks, epochs=cfg.epochs, global_batch_size=cfg.batch)
    seconds = time.perf_counter() - start
    after = strategy.wire_stats() if sharded else {}
    eval_keys, eval_clicks, eval_logit = make_data(cfg.eval_examples, cfg, seed=cfg.seed + 2)
    scores = trainer.predict(eval_keys, batch_size=4096)
    steps = -(-cfg.train_examples // cfg.batch) * cfg.epochs
    out = {"role": "worker", "auc": auc(scores, eval_clicks), "oracle_auc": auc(eval_logit, eval_clicks),
           "loss": history.history["loss"][-1], "seconds": seconds,
           "examples_per_s": cfg.train_examples * cfg.epochs / seconds,
           "peak_rss_mb": _peak_rss_mb(), "steps": steps,
           "table_mb": cfg.rows * cfg.dim * 4 / 2**20, "plain_table_fits": plain_table_fits}
    if sharded:
        wire = after["bytes_sent"] + after["bytes_received"] - before["bytes_sent"] - before["bytes_received"]
        ideal = after["row_bytes"] - before["row_bytes"]
        out.update({"wire_bytes_per_step": wire / steps, "ideal_bytes_per_step": ideal / steps,
                    "wire_over_ideal": wire / ideal if ideal else float("nan")})
    strategy.shutdown()
    return out


def _spawned(cfg_dict: dict) -> dict:
    return run(Config(**cfg_dict))


def launch(cfg: Config, timeout_s: float = 1800.0) -> list[dict]:
    """Run ``cfg`` on local processes with ``towers.spawn``; return every process's result."""
    write_click_log(cfg)  # once, here, before the processes start (each finds the files there)
    if cfg.strategy == "one_device":
        return [run(cfg)]
    nprocs = cfg.workers + (cfg.num_ps if cfg.strategy in ("hybrid", "ps") else 0)
    env = {"TOWERS_STRATEGY": cfg.strategy, "MALLOC_ARENA_MAX": "2"}
    if cfg.strategy in ("hybrid", "ps"):
        env["TOWERS_NUM_PS"] = str(cfg.num_ps)
    return towers.spawn(_spawned, nprocs, args=(asdict(cfg),), timeout_s=timeout_s, env=env,
                        threads_per_process=cfg.threads)


def report(cfg: Config, results: list[dict]) -> str:
    """Return the lines to print for one run."""
    workers = [r for r in results if r["role"] == "worker"]
    ps = [r for r in results if r["role"] == "ps"]
    w = workers[0]
    lines = [f"{cfg.strategy}: {cfg.workers if cfg.strategy != 'one_device' else 1} worker(s)"
             + (f" + {cfg.num_ps} ps ({cfg.mode})" if ps else "")
             + f", table {cfg.rows:,} x {cfg.dim} ({w['table_mb']:,.0f} MiB declared)",
             f"  AUC {w['auc']:.4f} (oracle {w['oracle_auc']:.4f}), final loss {w['loss']:.4f}",
             f"  {sum(r['examples_per_s'] for r in workers[:1]):,.0f} examples/s ({w['steps']} steps, "
             f"{w['seconds']:.1f} s)",
             "  worker peak RSS: " + ", ".join(f"{r['peak_rss_mb']:.0f} MB" for r in workers)
             + (f" (limit {cfg.worker_memory_gib:g} GiB of address space: the table is "
                f"{w['table_mb'] / 1024 / cfg.worker_memory_gib:.1f}x that; allocating it in a worker "
                f"{'succeeded' if w['plain_table_fits'] else 'fails'})" if cfg.worker_memory_gib else "")]
    if ps:
        lines.append(f"  ps links: {w['wire_bytes_per_step'] / 1e3:,.1f} kB/step per worker vs touched-rows ideal "
                     f"{w['ideal_bytes_per_step'] / 1e3:,.1f} kB ({w['wire_over_ideal']:.3f}x)")
        lines.append("  ps tasks: " + ", ".join(
            f"{sum(t['touched'] for t in r['tables']):,} rows touched, peak RSS {r['peak_rss_mb']:.0f} MB" for r in ps))
    return "\n".join(lines)


def verdict(results: list[dict], wall_s: float, tolerance: float = 0.03) -> str:
    """Return the closing line: the model's AUC against the oracle's, and whether it is within ``tolerance``."""
    w = next(r for r in results if r["role"] == "worker")
    gap = w["oracle_auc"] - w["auc"]
    return (f"AUC {w['auc']:.3f} vs oracle {w['oracle_auc']:.3f}: "
            + (f"within {tolerance:g}" if gap <= tolerance else f"NOT within {tolerance:g} (gap {gap:.3f})")
            + f", in {wall_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field_name, default in asdict(Config()).items():
        flag = "--" + field_name.replace("_", "-")
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--json", default=None, help="write the results here")
    args = vars(parser.parse_args(argv))
    out_path = args.pop("json")
    cfg = Config(**args)
    if "RANK" in os.environ:  # under `towers launch` / torchrun: this is one process of the job
        result = run(cfg)
        print(json.dumps(result))
        return 0
    start = time.perf_counter()
    results = launch(cfg)
    print(report(cfg, results))
    print(verdict(results, time.perf_counter() - start))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"config": asdict(cfg), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
