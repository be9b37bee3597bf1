"""Starting processes: ``towers.spawn`` for functions, ``towers launch`` (``launch(spec)``) for scripts."""

from towers.launch.launcher import LaunchError, launch
from towers.launch.spawn import RankState, SpawnError, cpu_threads_per_process, free_port, spawn
from towers.launch.spec import LaunchSpec, parse_launch_args

__all__ = [
    "spawn",
    "SpawnError",
    "RankState",
    "free_port",
    "cpu_threads_per_process",
    "launch",
    "LaunchError",
    "LaunchSpec",
    "parse_launch_args",
]
