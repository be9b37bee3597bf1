"""Strategies: how replicas cooperate. Importing this package registers the built-in names."""

from towers.strategies.base import (
    REDUCE_OPS,
    ReplicaContext,
    Strategy,
    current_replica_context,
    current_strategy,
    get_strategy,
    register_strategy,
    strategy_from_env,
    strategy_names,
)
from towers.strategies.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from towers.strategies.one_device import OneDeviceStrategy
from towers.strategies.parameter_server import ParameterServerStrategy

register_strategy("one_device", OneDeviceStrategy, aliases=("onedevice", "single"))
register_strategy("mirrored", MirroredStrategy)
register_strategy("multi_worker_mirrored", MultiWorkerMirroredStrategy, aliases=("multiworkermirrored", "mwms"))
register_strategy("ps", ParameterServerStrategy, aliases=("parameter_server", "parameterserver"))

__all__ = [
    "REDUCE_OPS",
    "ReplicaContext",
    "Strategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "current_replica_context",
    "current_strategy",
    "get_strategy",
    "register_strategy",
    "strategy_from_env",
    "strategy_names",
]
