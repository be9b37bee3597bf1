"""The GPU tier's report: the machine (GPUs, driver, torch / CUDA / NCCL versions), each check with its time, figures.

``collect_environment()`` describes the machine; ``checks_from_junit(path)`` reads pytest's JUnit XML
into ``CheckResult`` rows; a ``GpuReport`` holds both plus ``Figure`` rows (examples/s of ``towers
bench`` on the GPU, ...) and writes itself as JSON (``write_json``) and Markdown (``to_markdown``).
``tools/gpu_check.py`` (``make gpu-check``) runs the tier and writes the report with this module.

Where no CUDA device is visible every GPU check skips, and the report's first line says so:
``no CUDA device: N checks skipped``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from towers._logging import get_logger
from towers.errors import InvalidArgumentError

__all__ = ["OUTCOMES", "CheckResult", "Figure", "GpuReport", "collect_environment", "checks_from_junit",
           "driver_version"]

log = get_logger(__name__)

#: What a check can come to; "error" is a failure outside the test body (a fixture, a crash).
OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class CheckResult:
    """One check: its name (a pytest node id), outcome, duration and the skip reason or failure's first line."""

    name: str
    outcome: str
    duration_s: float
    message: str = ""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise InvalidArgumentError(f"outcome must be one of {OUTCOMES}. Received: {self.outcome!r}.")
        if not self.duration_s >= 0:
            raise InvalidArgumentError(f"duration_s must be >= 0 seconds. Received: {self.duration_s!r}.")


@dataclass(frozen=True)
class Figure:
    """One measured number, with its unit and the command that produced it."""

    name: str
    value: float
    unit: str
    command: str = ""
    note: str = ""


@dataclass
class GpuReport:
    """The machine, the checks and the figures of one run of the GPU tier."""

    environment: dict[str, Any]
    checks: list[CheckResult] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: str = ""
    duration_s: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        """Return how many checks came to each outcome (every outcome listed, zeros included)."""
        return {outcome: sum(1 for c in self.checks if c.outcome == outcome) for outcome in OUTCOMES}

    @property
    def ok(self) -> bool:
        """True when no check failed or errored (skips are fine: a machine without a GPU skips them all)."""
        counts = self.counts
        return counts["failed"] == 0 and counts["error"] == 0

    def summary(self) -> str:
        """Return the one-line verdict: ``no CUDA device: N checks skipped`` on a machine without one."""
        counts = self.counts
        tail = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o] and (o != "skipped" or self._has_gpu()))
        if not self._has_gpu():
            line = f"no CUDA device: {counts['skipped']} checks skipped"
            return f"{line}; {tail}" if tail else line
        names = sorted({d.get("name", "?") for d in self.environment.get("gpus", [])})
        return f"{', '.join(names) or 'GPU'}: {tail or 'no checks ran'}"

    def _has_gpu(self) -> bool:
        return bool(self.environment.get("cuda_available")) and int(self.environment.get("gpu_count", 0)) > 0

    def to_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return {"summary": self.summary(), "ok": self.ok, "started": self.started, "duration_s": self.duration_s,
                "counts": self.counts, "environment": self.environment,
                "checks": [asdict(c) for c in self.checks], "figures": [asdict(f) for f in self.figures],
                "notes": list(self.notes)}

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_dict()`` to ``path`` (parents created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    def write_markdown(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_markdown()`` to ``path`` (parents created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_markdown(), encoding="utf-8")
        return path

    def to_markdown(self) -> str:
        """Return the report as Markdown: the verdict, the machine, one row per check, one per figure."""
        env = self.environment
        lines = ["# towers GPU check", "", f"**{self.summary()}**", ""]
        if self.started:
            lines += [f"Started {self.started}; took {self.duration_s:.1f} s.", ""]
        lines += ["## Machine", "", "| | |", "| --- | --- |"]
        gpus = env.get("gpus") or []
        rows = [("GPUs", "; ".join(f"{g['index']}: {g['name']} ({g['total_memory_gib']} GiB, sm_{g['capability']})"
                                   for g in gpus) or "none visible"),
                ("NVIDIA driver", env.get("driver_version") or "not found"),
                ("torch", env.get("torch_version")),
                ("CUDA (torch built with)", env.get("cuda_version") or "none: a CPU-only build"),
                ("NCCL", env.get("nccl_version") or "not available"),
                ("cuDNN", env.get("cudnn_version") or "not available"),
                ("distributed backends", ", ".join(k for k, v in (env.get("distributed_backends") or {}).items() if v)
                 or "none"),
                ("Python", env.get("python")), ("platform", env.get("platform")), ("CPU cores", env.get("cpu_cores"))]
        lines += [f"| {name} | {_cell(value)} |" for name, value in rows]
        lines += ["", "## Checks", "", "| check | outcome | seconds | note |", "| --- | --- | --- | --- |"]
        lines += [f"| {_cell(c.name)} | {c.outcome} | {c.duration_s:.2f} | {_cell(c.message)} |" for c in self.checks]
        if not self.checks:
            lines.append("| (none ran) | | | |")
        if self.figures:
            lines += ["", "## Figures", "", "| figure | value | command |", "| --- | --- | --- |"]
            for f in self.figures:
                value = f"{f.value:,.1f} {_cell(f.unit)}" + (f" ({_cell(f.note)})" if f.note else "")
                lines.append(f"| {_cell(f.name)} | {value} | {f'`{f.command}`' if f.command else ''} |")
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    """Return ``value`` as one Markdown table cell (no pipes or line breaks)."""
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")


def driver_version() -> str | None:
    """Return the NVIDIA driver's version (``nvidia-smi``, else ``/proc/driver/nvidia/version``), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        first = done.stdout.strip().splitlines()[:1]
        if done.returncode == 0 and first and first[0].strip():
            return first[0].strip()
    except (OSError, subprocess.SubprocessError):  # no nvidia-smi here, or it hung
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def collect_environment() -> dict[str, Any]:
    """Return the machine as JSON-ready data: GPUs, driver, torch / CUDA / NCCL / cuDNN versions, Python, cores."""
    import torch

    from towers.devices import describe_devices, gpu_count

    count = gpu_count()
    gpus = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": props.name, "capability": f"{props.major}{props.minor}",
                     "total_memory_gib": round(props.total_memory / 2**30, 1),
                     "multiprocessors": int(props.multi_processor_count)})
    nccl = None
    if torch.version.cuda:
        try:
            found = torch.cuda.nccl.version()
            nccl = ".".join(str(v) for v in found) if isinstance(found, tuple) else str(found)
        except (AttributeError, RuntimeError):  # a CUDA build without NCCL
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": count,
        "gpus": gpus,
        "driver_version": driver_version() if torch.version.cuda else None,
        "nccl_version": nccl,
        "cudnn_version": str(cudnn) if cudnn else None,
        "distributed_backends": describe_devices()["distributed_backends"],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def checks_from_junit(path: str | os.PathLike[str]) -> list[CheckResult]:
    """Return one ``CheckResult`` per test case of the JUnit XML report pytest wrote at ``path``.

    Names are ``file::test`` (``-o junit_family=xunit1`` writes the file) or ``class::test``.

    Raises:
        ValueError: when the file is not JUnit XML.
    """
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise InvalidArgumentError(f"{path} is not JUnit XML ({exc}). Expected the file of pytest --junitxml.") from None
    results = []
    for case in root.iter("testcase"):
        where = case.get("file") or case.get("classname") or "?"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = _first_line(element.get("message") or element.text or "")
                break
        results.append(CheckResult(f"{where}::{case.get('name', '?')}", outcome, float(case.get("time") or 0.0),
                                   message))
    return results


def _first_line(text: str) -> str:
    text = text.strip()
    text = re.sub(r"^Skipped:\s*", "", text)
    return text.splitlines()[0] if text else ""

