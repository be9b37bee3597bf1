"""Strategies: how replicas cooperate. Built-in names live in ``towers.cluster.roles.STRATEGIES``."""

from towers.strategies.base import (
    REDUCE_OPS,
    PeerLostError,
    ReplicaContext,
    Strategy,
    current_replica_context,
    current_strategy,
    get_strategy,
    register_strategy,
    strategy_from_env,
    strategy_names,
)
from towers.strategies.fault_tolerant import FaultTolerantStrategy
from towers.strategies.fully_sharded import FullyShardedStrategy
from towers.strategies.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from towers.strategies.one_device import OneDeviceStrategy
from towers.strategies.parameter_server import ParameterServerStrategy

__all__ = [
    "REDUCE_OPS",
    "PeerLostError",
    "ReplicaContext",
    "Strategy",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy",
    "FullyShardedStrategy",
    "FaultTolerantStrategy",
    "current_replica_context",
    "current_strategy",
    "get_strategy",
    "register_strategy",
    "strategy_from_env",
    "strategy_names",
]
