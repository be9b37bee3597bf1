"""Scaling benchmark: towers strategies beside hand-written DDP, per replica count (table, JSON, PNG).

Names are imported lazily: ``towers.bench.config`` and ``towers.bench.report`` do not need torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "STRATEGIES": "towers.bench.config",
    "BenchConfig": "towers.bench.config",
    "available_cores": "towers.bench.config",
    "RAW": "towers.bench.report",
    "BenchReport": "towers.bench.report",
    "Measurement": "towers.bench.report",
    "Row": "towers.bench.report",
    "summarize": "towers.bench.report",
    "run_benchmark": "towers.bench.runner",
    "WorkloadSpec": "towers.bench.workloads",
    "RawTorchWorkload": "towers.bench.workloads",
    "TowersWorkload": "towers.bench.workloads",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'towers.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
