"""A click-through-rate model whose embedding table lives on parameter servers (HybridStrategy).

Synthetic clicks with a known ground truth: each example has ``--fields`` categorical features
(ids drawn log-uniformly from ``--vocab`` values per field: a few very frequent, a long tail);
the true click logit is a sum of one hidden weight per (field, id) plus an interaction of the
first two fields, and the label is drawn from it. The oracle AUC (ranking by the true logit) is
printed beside the model's, so AUC means something.

The model: one hashed ``towers.ShardedEmbedding`` table of ``--rows`` rows shared by all fields
(id ``v`` of field ``f`` hashes ``f * 2**40 + v``; distinct keys may collide), concatenated and
fed to an MLP. Under ``HybridStrategy`` the rows live on the ps tasks (row-wise Adagrad there)
and the MLP is all-reduced among the workers; ``Trainer.fit`` runs it, one script for all.

    # 2 workers + 1 ps task on this host (self-contained: towers.spawn)
    python examples/recommender.py --workers 2 --num-ps 1
    # the same under the launcher
    towers launch --strategy hybrid --num-ps 1 --nproc-per-node 3 examples/recommender.py
    # the reference: one process, a plain nn.Embedding of the same rows, same optimizer
    python examples/recommender.py --strategy one_device
    # the table replicated on every worker and all-reduced (MirroredStrategy)
    python examples/recommender.py --strategy mirrored --workers 2
    # a table 4x larger than a worker may use: 120M rows x 16 (7.2 GiB) with workers limited to 1.5 GiB
    python examples/recommender.py --workers 2 --num-ps 1 --rows 120000000 --worker-memory-gib 1.5

Prints (and with ``--json PATH`` writes) AUC, oracle AUC, examples/s, each worker's peak RSS,
bytes on the ps links per step vs the touched-rows ideal, and the rows the ps tasks hold.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import towers


@dataclass
class Config:
    strategy: str = "hybrid"
    workers: int = 2
    num_ps: int = 1
    mode: str = "sync"
    rows: int = 1 << 20
    dim: int = 16
    fields: int = 8
    vocab: int = 200_000
    train_examples: int = 65_536
    eval_examples: int = 16_384
    batch: int = 1024
    lr: float = 0.05
    seed: int = 0
    worker_memory_gib: float = 0.0
    threads: int = 1


# --- data with a known ground truth -------------------------------------------------------------------
def _hidden(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """A fixed pseudo-random weight in [-1, 1] per key (no table: any vocabulary size works)."""
    return towers.ShardedEmbedding.hash(keys, 2_000_001, seed=salt).to(torch.float32) / 1_000_000.0 - 1.0


def make_data(n: int, cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(keys [n, fields] int64, clicks [n] float, true logits [n])``."""
    g = torch.Generator().manual_seed(seed)
    ids = (cfg.vocab ** torch.rand(n, cfg.fields, generator=g, dtype=torch.float64)).long() - 1
    keys = ids + (torch.arange(cfg.fields, dtype=torch.int64) << 40)
    logit = 1.5 * _hidden(keys, 1).sum(1) / math.sqrt(cfg.fields) + 1.5 * _hidden(keys[:, 0] ^ keys[:, 1], 2) - 1.0
    clicks = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return keys, clicks, logit


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
    """The same hashed table as a plain ``nn.Embedding`` (one process, or replicated under Mirrored)."""

    def __init__(self, rows: int, dim: int, seed: int):
        super().__init__()
        self.rows, self.seed = rows, seed
        self.table = nn.Embedding(rows, dim, _weight=towers.ShardedEmbedding(rows, dim, seed=seed).initial_weight())

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.table(towers.ShardedEmbedding.hash(keys, self.rows, seed=self.seed))


class CTRModel(nn.Module):
    """Embeddings of every field, concatenated, then an MLP: one click logit per example."""

    def __init__(self, table: nn.Module, fields: int, dim: int):
        super().__init__()
        self.table = table
        self.mlp = nn.Sequential(nn.Linear(fields * dim, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(keys).flatten(1)).squeeze(-1)


def build(cfg: Config, sharded: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return the model and its optimizer (Adagrad everywhere: row-wise on the ps equals dense Adagrad)."""
    torch.manual_seed(cfg.seed)
    if sharded:
        table: nn.Module = towers.ShardedEmbedding(cfg.rows, cfg.dim, mode="none", hashed=True, optimizer="adagrad",
                                                    lr=cfg.lr, seed=cfg.seed)
    else:
        table = PlainHashedEmbedding(cfg.rows, cfg.dim, cfg.seed)
    model = CTRModel(table, cfg.fields, cfg.dim)
    return model, torch.optim.Adagrad(model.parameters(), lr=cfg.lr)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(cfg: Config) -> dict:
    """Train one epoch and evaluate; return this process's measurements (a ps task returns its own)."""
    torch.set_num_threads(cfg.threads)
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
    keys, clicks, _ = make_data(cfg.train_examples, cfg, seed=cfg.seed + 1)
    before = strategy.wire_stats() if sharded else {}
    start = time.perf_counter()
    history = trainer.fit(TensorDataset(keys, clicks), epochs=1, global_batch_size=cfg.batch, shuffle=False)
    seconds = time.perf_counter() - start
    after = strategy.wire_stats() if sharded else {}
    eval_keys, eval_clicks, eval_logit = make_data(cfg.eval_examples, cfg, seed=cfg.seed + 2)
    scores = trainer.predict(eval_keys, batch_size=4096)
    steps = -(-cfg.train_examples // cfg.batch)
    out = {"role": "worker", "auc": auc(scores, eval_clicks), "oracle_auc": auc(eval_logit, eval_clicks),
           "loss": history.history["loss"][-1], "seconds": seconds, "examples_per_s": cfg.train_examples / seconds,
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
    results = launch(cfg)
    print(report(cfg, results))
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"config": asdict(cfg), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
