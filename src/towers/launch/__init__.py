"""Starting processes: ``towers.spawn`` for functions, ``towers launch`` for scripts."""

from towers.launch.spawn import RankState, SpawnError, cpu_threads_per_process, free_port, spawn

__all__ = ["spawn", "SpawnError", "RankState", "free_port", "cpu_threads_per_process"]
