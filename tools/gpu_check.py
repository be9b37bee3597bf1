"""Run the GPU tier on this machine and write its report (``make gpu-check``; docs/gpu.md).

1. pytest over ``tests/gpu`` and the unit tests that run on any machine: the GPU choices with a faked
   GPU count (``tests/unit/test_gpu_selection.py``) and this report (``tests/unit/test_gpu_report.py``),
   with a JUnit XML file;
2. a short ``towers bench`` on the GPU (skipped without one): examples/s of towers and of raw torch;
3. the report (``towers.diagnostics.gpu_report``): ``<out-dir>/gpu-report.json`` and ``gpu-report.md``.

Exit code 0 when no check failed (a machine without a GPU skips every GPU check and exits 0), 1 when
one failed or the tier ran out of time, 2 on bad arguments. The whole run keeps within ``--budget-s``.
Runs with any Python that has torch (towers is taken from ``src/``), so a machine whose own Python
already holds a CUDA build of torch needs no install: ``make gpu-check GPU_PY=python3``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from towers.diagnostics.gpu_report import (  # noqa: E402  (after the path: towers need not be installed)
    CheckResult,
    Figure,
    GpuReport,
    checks_from_junit,
    collect_environment,
)

#: What the tier runs: the GPU tests, and the unit tests of the choices made for GPUs and of the report (any machine).
TIER = ("tests/gpu", "tests/unit/test_gpu_selection.py", "tests/unit/test_gpu_report.py")

#: Seconds kept back from the tests for the benchmark, on a machine with a GPU.
BENCH_RESERVE_S = 150.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(argv: Sequence[str], *, log_path: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run ``argv`` in its own session, its output shown and copied to ``log_path``; return (exit code or None, seconds).

    None: the deadline passed and the whole session was killed.
    """
    started = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)

        def tee() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        reader.join(5.0)
    return code, time.monotonic() - started


def run_tier(out_dir: Path, timeout_s: float, extra: Sequence[str]) -> tuple[list[CheckResult], list[str]]:
    """Run pytest over ``TIER``; return its checks and notes."""
    junit = out_dir / "junit.xml"
    junit.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TIER, f"--junitxml={junit}",
            "-o", "junit_family=xunit1", *extra]
    print(f"gpu-check: {' '.join(argv[1:])}  (deadline {timeout_s:.0f} s)", flush=True)
    code, took = _run(argv, log_path=out_dir / "pytest.log", timeout_s=timeout_s)
    checks = checks_from_junit(junit) if junit.exists() else []
    notes = []
    if code is None:
        checks.append(CheckResult("tools/gpu_check.py::the tier within its deadline", "error", took,
                                  f"pytest was still running after {timeout_s:.0f} s and was killed"))
    elif code not in (0, 1) or not checks:  # 1: tests failed (they are in the XML); anything else: pytest itself
        checks.append(CheckResult("tools/gpu_check.py::pytest", "error", took,
                                  f"pytest exited with code {code}; see pytest.log"))
    notes.append(f"pytest log: {out_dir / 'pytest.log'}")
    return checks, notes


def run_bench(out_dir: Path, environment: dict, timeout_s: float, steps: int) -> tuple[CheckResult, list[Figure]]:
    """Run a short ``towers bench`` on the GPU(s); return its check and its examples/s."""
    name = "tools/gpu_check.py::towers bench on cuda"
    if not environment["cuda_available"]:
        return CheckResult(name, "skipped", 0.0, "no CUDA device"), []
    replicas = "1,2" if environment["gpu_count"] >= 2 else "1"  # one GPU per replica, as the strategies place them
    bench_dir = out_dir / "bench"
    argv = [sys.executable, "-m", "towers.cli", "bench", "--replicas", replicas, "--steps", str(steps), "--warmup", "5",
            "--repeats", "3", "--batch-size", "256", "--no-plot", "--out-dir", str(bench_dir),
            "--timeout-s", str(int(max(30.0, timeout_s - 15)))]
    command = "towers " + " ".join(argv[3:])
    print(f"gpu-check: {command}", flush=True)
    code, took = _run(argv, log_path=out_dir / "bench.log", timeout_s=timeout_s)
    if code != 0:
        why = "timed out" if code is None else f"exited with code {code}"
        return CheckResult(name, "failed", took, f"towers bench {why}; see bench.log"), []
    data = json.loads((bench_dir / "bench.json").read_text(encoding="utf-8"))
    devices = data.get("environment", {}).get("devices", [])
    figures = []
    for row in data.get("rows", []):
        note = f"{row['vs_raw']:.2f}x raw torch" if row.get("vs_raw") is not None else ""
        figures.append(Figure(f"towers bench: {row['strategy']} on {row['replicas']} replica(s), {row['engine']}",
                              float(row["median"]), "examples/s", command, note))
    if not devices or any(not d.startswith("cuda") for d in devices):
        return CheckResult(name, "failed", took, f"the replicas computed on {devices or 'an unknown device'}, "
                                                 "not on the GPU"), figures
    return CheckResult(name, "passed", took, f"replicas on {', '.join(devices)}"), figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="towers-out/gpu-check", help="where the report goes")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole run's deadline in seconds")
    parser.add_argument("--bench-steps", type=int, default=30, help="timed steps per repeat of towers bench")
    parser.add_argument("--no-bench", action="store_true", help="skip towers bench")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = parser.parse_args(argv)
    if args.budget_s < 60 or args.bench_steps < 1:
        print(f"gpu-check: error: --budget-s must be >= 60 and --bench-steps >= 1. Received: {args.budget_s}, "
              f"{args.bench_steps}.", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir = out_dir if out_dir.is_absolute() else ROOT / out_dir
    started, clock = datetime.now(timezone.utc), time.monotonic()
    environment = collect_environment()
    gpus = ", ".join(g["name"] for g in environment["gpus"]) or "no CUDA device"
    print(f"gpu-check: {gpus}; torch {environment['torch_version']}, CUDA {environment['cuda_version']}, "
          f"NCCL {environment['nccl_version']}, driver {environment['driver_version']}", flush=True)
    bench = environment["cuda_available"] and not args.no_bench
    checks, notes = run_tier(out_dir, args.budget_s - (BENCH_RESERVE_S if bench else 0.0), args.pytest_args)
    figures: list[Figure] = []
    if args.no_bench:
        notes.append("towers bench left out (--no-bench)")
    else:
        left = args.budget_s - (time.monotonic() - clock)
        check, figures = run_bench(out_dir, environment, max(30.0, left), args.bench_steps)
        checks.append(check)
    report = GpuReport(environment=environment, checks=checks, figures=figures, notes=notes,
                       started=started.isoformat(timespec="seconds"), duration_s=time.monotonic() - clock)
    written = [report.write_json(out_dir / "gpu-report.json"), report.write_markdown(out_dir / "gpu-report.md")]
    print(f"gpu-check: {report.summary()}")
    for path in written:
        print(f"gpu-check: wrote {path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
