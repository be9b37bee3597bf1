"""towers: data-parallel training across devices and machines, on PyTorch.

Public names are imported lazily, so ``import towers`` stays cheap and a CLI subcommand
loads only what it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # devices and placement
    "Device": "towers.devices",
    "list_devices": "towers.devices",
    "device": "towers.devices",
    "set_soft_device_placement": "towers.devices",
    "get_soft_device_placement": "towers.devices",
    "log_device_placement": "towers.devices",
    # processes
    "spawn": "towers.launch",
    # strategies
    "Strategy": "towers.strategies",
    "OneDeviceStrategy": "towers.strategies",
    "MirroredStrategy": "towers.strategies",
    "MultiWorkerMirroredStrategy": "towers.strategies",
    "ParameterServerStrategy": "towers.strategies",
    "FullyShardedStrategy": "towers.strategies",
    "FaultTolerantStrategy": "towers.strategies",
    "HybridStrategy": "towers.strategies.hybrid",
    "ShardedEmbedding": "towers.strategies.parameter_server.embeddings",
    "get_strategy": "towers.strategies",
    "strategy_from_env": "towers.strategies",
    "current_strategy": "towers.strategies",
    # input
    "Shards": "towers.data",
    "InputContext": "towers.data",
    # losses
    "compute_average_loss": "towers.losses",
    "scale_regularization_loss": "towers.losses",
    # weights
    "ExponentialMovingAverage": "towers.ema",
    # training
    "Trainer": "towers.training",
    "History": "towers.training",
    # diagnostics
    "ThroughputMeter": "towers.diagnostics.throughput",
    # errors: `except towers.TowersError` catches every error towers raises for a person to act on
    "TowersError": "towers.errors",
    "InvalidArgumentError": "towers.errors",
    "InvalidTypeError": "towers.errors",
    "FailedPreconditionError": "towers.errors",
    "UnimplementedError": "towers.errors",
    "NotFoundError": "towers.errors",
    "DeadlineExceededError": "towers.errors",
}

_SUBMODULES = {
    "cluster": "towers.cluster",
    "callbacks": "towers.callbacks",
    "metrics": "towers.metrics",
    "checkpoint": "towers.checkpoint",
    "data": "towers.data",
    "ray": "towers.ray",
}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'towers' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
