"""One GPU, within 8 minutes: a ~1B GPT's MFU, the Trainer against a raw loop, and memory policies (``make gpu-bench``).

Three parts, each on its own time budget (a share of ``--budget-s``; time a part leaves goes to the next):

- (a) **MFU of a GPT that fills the GPU**: ``GPTConfig.large()`` (1.04B parameters, context 2048) in bf16,
  compiled, each block's activations checkpointed, at the largest power-of-two micro-batch a memory
  probe finds room for; raw torch, towers' custom loop and ``Trainer.fit``, interleaved; tokens/s,
  MFU (FLOPs per token from torch's FlopCounterMode, the GPU's datasheet bf16 peak) and each over raw;
- (b) **the Trainer at a raw loop's speed on a small model**: the seed CNN at batch 256, fp32 and bf16,
  the same three engines (``gpu_throughput.py``'s), each over raw (goal: >= 0.95);
- (c) **memory policies on the 1B model**: towers' loop with ``activation_checkpointing`` off / block /
  selective, the raw loop's hand-made checkpointing, and ``FullyShardedStrategy(cpu_offload=True)`` on
  one process: peak memory (``torch.cuda.max_memory_allocated``) and step time, one after another.

Writes ``<out-dir>/gpu-bench.json`` and ``gpu-bench.md`` after each part. Exit code 0 when every part ran
(an engine's OOM or a missing option is a finding, in the report), also on a machine without a GPU (the
report says "skipped: no GPU"); 1 when a part failed or the run hit its hard limit; 2 on bad arguments.

    python benchmarks/gpu_bench.py                           # all three parts, ~7 min on an H100
    python benchmarks/gpu_bench.py --parts a --batch 16      # part (a) only, no memory probe
    python benchmarks/gpu_bench.py --device cpu --tiny       # a smoke run without a GPU: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # towers from src/: a Python with CUDA torch needs no install
sys.path.insert(0, str(ROOT / "benchmarks"))  # the sibling modules, also when this one is imported
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch starts CUDA

import torch  # noqa: E402

#: Each part's share of the budget, in the order the parts run (the cheap, sure one first).
SHARES = {"b": 0.10, "a": 0.62, "c": 0.28}
#: Seconds past ``--budget-s`` after which the run stops where it is (a compilation cannot be cut short).
HARD_GRACE_S = 45.0
SKIPPED_NO_GPU = "skipped: no GPU"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out-dir", default="towers-out/gpu-bench", help="where gpu-bench.json and .md go")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default); cpu only with --tiny")
    p.add_argument("--tiny", action="store_true",
                   help="smoke sizes: the tests' tiny GPT, 2 steps, 1 repeat, CNN batch 8 in fp32, no compilation")
    p.add_argument("--parts", default="a,b,c", help="comma-separated, of a, b, c (default: all)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help=f"seconds for all parts (default 400; the run stops hard {HARD_GRACE_S:.0f} s after it)")
    p.add_argument("--steps", type=int, default=None, help="(a) steps per timed block (default 10; --tiny 2)")
    p.add_argument("--repeats", type=int, default=None, help="(a) interleaved repeats (default 3; --tiny 1)")
    p.add_argument("--batch", type=int, default=None, help="(a, c) micro-batch of the GPT (default: a memory probe)")
    p.add_argument("--start-batch", type=int, default=64, help="(a) the probe's first try; halved on OOM (default 64)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="(a) torch.compile the GPT engines (auto: on for cuda, off for cpu)")
    p.add_argument("--memory-compile", action="store_true", help="(c) compile the policies' models too (slower)")
    p.add_argument("--memory-repeats", type=int, default=None, help="(c) timed steps per policy (default 3; --tiny 1)")
    p.add_argument("--cnn-modes", default=None, help="(b) of fp32, bf16 (default both; --tiny fp32)")
    p.add_argument("--cnn-steps", type=int, default=None, help="(b) steps per timed block (default 30; --tiny 2)")
    p.add_argument("--cnn-repeats", type=int, default=None, help="(b) interleaved repeats (default 5; --tiny 1)")
    return p


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    tiny = args.tiny
    return {"steps": args.steps or (2 if tiny else 10), "repeats": args.repeats or (1 if tiny else 3),
            "memory_repeats": args.memory_repeats or (1 if tiny else 3),
            "cnn_modes": (args.cnn_modes or ("fp32" if tiny else "fp32,bf16")).split(","),
            "cnn_steps": args.cnn_steps or (2 if tiny else 30), "cnn_repeats": args.cnn_repeats or (1 if tiny else 5),
            "cnn_batch": 8 if tiny else 256,
            "compile": args.compile == "on" or (args.compile == "auto" and args.device == "cuda")}


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in SHARES]
    if bad or not parts:
        p.error(f"--parts takes a comma-separated list of a, b, c. Received: {args.parts!r}.")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu runs the smoke sizes only (a 1B GPT on a CPU would take hours). Add --tiny.")
    numbers = {"--budget-s": args.budget_s, "--steps": args.steps, "--repeats": args.repeats, "--batch": args.batch,
               "--start-batch": args.start_batch, "--memory-repeats": args.memory_repeats,
               "--cnn-steps": args.cnn_steps, "--cnn-repeats": args.cnn_repeats}
    low = {k: v for k, v in numbers.items() if v is not None and v < 1}
    if low:
        p.error(f"these must be >= 1. Received: {low}.")
    modes = (args.cnn_modes or "fp32").split(",")
    if any(m not in ("fp32", "bf16") for m in modes):
        p.error(f"--cnn-modes takes fp32 and/or bf16. Received: {args.cnn_modes!r}.")
    return parts


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                           "cpu_cores": os.cpu_count(), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=torch.cuda.get_device_name(device), device_memory_gib=props.total_memory / 2**30)
    else:
        env["device"] = "cpu"
    return env


class Report:
    """The run's record: written to ``gpu-bench.json`` and ``gpu-bench.md`` whenever a part ends."""

    def __init__(self, out_dir: Path, head: dict[str, Any]):
        self.out_dir = out_dir
        self.data: dict[str, Any] = {**head, "parts": {}}
        self._lock = threading.Lock()

    def write(self) -> None:
        from _gpu_bench_report import render

        with self._lock:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            text = json.dumps(self.data, indent=1, default=str)
            (self.out_dir / "gpu-bench.json").write_text(text + "\n", encoding="utf-8")
            (self.out_dir / "gpu-bench.md").write_text(render(json.loads(text)), encoding="utf-8")


def _part_b(device: torch.device, s: dict[str, Any], deadline: float) -> dict[str, Any]:
    import gpu_throughput

    out: dict[str, Any] = {"batch": s["cnn_batch"], "steps_per_block": s["cnn_steps"], "rows": [], "notes": []}
    modes = s["cnn_modes"]
    for i, mode in enumerate(modes):
        mode_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(modes) - i)
        result = gpu_throughput.measure("cnn", mode, device, s["cnn_steps"], s["cnn_repeats"], batch=s["cnn_batch"],
                                        deadline=mode_deadline)
        out["rows"] += gpu_throughput.summarise(result)
        if result["stopped"]:
            out["notes"].append(f"{mode}: {result['stopped']}")
    return out


def _part_a(device: torch.device, s: dict[str, Any], args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    from _gpu_bench_gpt import run_mfu

    from towers.models_gpt import GPTConfig

    config = GPTConfig.tiny() if args.tiny else GPTConfig.large()
    return run_mfu(config, device, steps=s["steps"], repeats=s["repeats"], compile=s["compile"], batch=args.batch,
                   start_batch=4 if args.tiny else args.start_batch, deadline=deadline)


def _part_c(device: torch.device, s: dict[str, Any], args: argparse.Namespace, batch: int | None,
            deadline: float) -> dict[str, Any]:
    from _gpu_bench_gpt import choose_batch, run_memory

    from towers.models_gpt import GPTConfig

    config = GPTConfig.tiny() if args.tiny else GPTConfig.large()
    notes = []
    if batch is None:  # part (a) did not run: the batch that three engines would share, as (a) would choose it
        batch, tried = choose_batch(config, device, start=4 if args.tiny else args.start_batch)
        notes.append(f"micro-batch from the memory probe: {', '.join(tried) or batch}")
        if batch == 0:
            return {"batch": 0, "rows": [], "notes": notes + ["no batch fits: nothing measured"]}
    out = run_memory(config, device, batch=batch, repeats=s["memory_repeats"], compile=args.memory_compile,
                     deadline=deadline)
    out["notes"] = notes + out["notes"]
    return out


def _hard_stop(report: Report, after_s: float) -> threading.Timer:
    def stop() -> None:
        report.data["stopped"] = f"hard limit: the run passed --budget-s + {HARD_GRACE_S:.0f} s and was stopped"
        try:
            report.write()
        finally:
            print(report.data["stopped"], flush=True)
            os._exit(1)
    timer = threading.Timer(after_s, stop)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    parts = _check(p, args)
    started = time.monotonic()
    device = torch.device(args.device)
    command = "python benchmarks/gpu_bench.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    head = {"command": command.strip(), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tiny": args.tiny, "budget_s": args.budget_s, "skipped": None}
    report = Report(Path(args.out_dir), head)
    if device.type == "cuda" and not torch.cuda.is_available():
        report.data["skipped"] = (f"{SKIPPED_NO_GPU}: torch {torch.__version__} sees no CUDA device. Run it on a GPU "
                                  "machine, or pass --device cpu --tiny for a smoke run.")
        report.data.update(_environment(torch.device("cpu")), device="no CUDA device",
                           elapsed_s=time.monotonic() - started)
        report.write()
        print(report.data["skipped"], flush=True)
        return 0
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (part b); bf16 is unaffected
    report.data.update(_environment(device))
    report.data["settings"] = s = _settings(args)
    print(f"gpu-bench on {report.data['device']}, torch {torch.__version__}; budget {args.budget_s:.0f} s", flush=True)
    timer = _hard_stop(report, args.budget_s + HARD_GRACE_S)
    runs: dict[str, Callable[[float], dict[str, Any]]] = {
        "a": lambda d: _part_a(device, s, args, d), "b": lambda d: _part_b(device, s, d),
        "c": lambda d: _part_c(device, s, args, report.data["parts"].get("a", {}).get("batch") or args.batch, d)}
    failed = False
    order = [x for x in SHARES if x in parts]
    try:
        for i, name in enumerate(order):
            left = args.budget_s - (time.monotonic() - started)
            budget = max(0.0, left * SHARES[name] / sum(SHARES[x] for x in order[i:]))
            t0 = time.monotonic()
            print(f"part {name}: budget {budget:.0f} s", flush=True)
            try:
                result = runs[name](t0 + budget)
            except Exception as exc:  # noqa: BLE001 (the other parts still run and report)
                traceback.print_exc()
                result, failed = {"error": f"{type(exc).__name__}: {exc}"}, True
            result.update(budget_s=budget, elapsed_s=time.monotonic() - t0)
            report.data["parts"][name] = result
            report.data["elapsed_s"] = time.monotonic() - started
            report.write()
    finally:
        timer.cancel()
    print(f"wrote {Path(args.out_dir) / 'gpu-bench.md'} ({time.monotonic() - started:.0f} s)", flush=True)
    print((Path(args.out_dir) / "gpu-bench.md").read_text(encoding="utf-8"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
