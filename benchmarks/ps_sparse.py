"""Sparse embeddings on parameter servers vs the table replicated and all-reduced, on this host.

Runs ``examples/recommender.py`` (one epoch of ``Trainer.fit``, each run its own job) for:

* ``hybrid``: 2 workers + 1 ps task, the hashed table on the ps (row-wise Adagrad), MLP all-reduced;
* ``mirrored``: 2 replicas, the same table as a plain ``nn.Embedding`` on every replica, its dense
  gradient all-reduced and dense Adagrad stepped every step (what the table costs without a ps);
* ``one_device``: one process, plain table (the AUC reference; run once: deterministic).

hybrid and mirrored runs are interleaved (h, m, h, m, ...) and the median examples/s of
``--repeats`` is reported with the load average; bytes on the ps links per step vs the
touched-rows ideal, worker peak RSS and AUC are exact (no timing noise).

    python benchmarks/ps_sparse.py --repeats 3 --json /tmp/ps_sparse.json
    python benchmarks/ps_sparse.py --rows 120000000 --worker-memory-gib 1.5 --repeats 1 --skip-mirrored

Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "recommender.py"


def _run(args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        done = subprocess.run([sys.executable, str(EXAMPLE), *args, "--json", str(out)], capture_output=True,
                              text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())["results"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--train-examples", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker-memory-gib", type=float, default=0.0)
    parser.add_argument("--skip-mirrored", action="store_true")
    parser.add_argument("--skip-one-device", action="store_true")
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    # One epoch over the long-tailed 200k-id vocabulary: many distinct rows per step, the ps's case (the
    # example's own default, 1k ids and two epochs, is for its AUC).
    common = ["--rows", str(a.rows), "--dim", str(a.dim), "--train-examples", str(a.train_examples),
              "--batch", str(a.batch), "--vocab", "200000", "--epochs", "1"]
    limit = ["--worker-memory-gib", str(a.worker_memory_gib)] if a.worker_memory_gib else []
    runs: dict[str, list[list[dict]]] = {"hybrid": [], "mirrored": []}
    loads = [os.getloadavg()[0]]
    for _ in range(a.repeats):
        runs["hybrid"].append(_run([*common, *limit, "--strategy", "hybrid", "--workers", "2", "--num-ps", "1"]))
        if not a.skip_mirrored:
            runs["mirrored"].append(_run([*common, "--strategy", "mirrored", "--workers", "2"]))
        loads.append(os.getloadavg()[0])
    one = None if a.skip_one_device else _run([*common, "--strategy", "one_device"])[0]
    summary: dict = {"rows": a.rows, "dim": a.dim, "table_mib": a.rows * a.dim * 4 / 2**20, "repeats": a.repeats,
                     "load_average_1min": loads}
    for name, results in runs.items():
        if not results:
            continue
        workers = [[r for r in res if r["role"] == "worker"] for res in results]
        summary[name] = {
            "examples_per_s_median": statistics.median(w[0]["examples_per_s"] for w in workers),
            "examples_per_s_all": [round(w[0]["examples_per_s"]) for w in workers],
            "worker_peak_rss_mb": max(r["peak_rss_mb"] for w in workers for r in w),
            "auc": workers[0][0]["auc"], "oracle_auc": workers[0][0]["oracle_auc"],
        }
        if name == "hybrid":
            w0 = workers[0][0]
            ps = [r for r in results[0] if r["role"] == "ps"]
            summary[name].update({"wire_bytes_per_step": w0["wire_bytes_per_step"],
                                  "ideal_bytes_per_step": w0["ideal_bytes_per_step"],
                                  "wire_over_ideal": w0["wire_over_ideal"],
                                  "ps_peak_rss_mb": max(r["peak_rss_mb"] for r in ps),
                                  "ps_rows_touched": sum(t["touched"] for r in ps for t in r["tables"]),
                                  "plain_table_fits_in_worker": w0["plain_table_fits"]})
    if one is not None:
        summary["one_device"] = {"auc": one["auc"], "examples_per_s": one["examples_per_s"],
                                 "peak_rss_mb": one["peak_rss_mb"]}
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": runs, "one_device": one}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
