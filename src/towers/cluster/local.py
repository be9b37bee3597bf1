"""The fallback: a script started with plain ``python`` is one process, rank 0 of 1."""

from __future__ import annotations

from typing import Mapping

from towers.cluster.base import ClusterEnvironment, launch_options
from towers.cluster.info import ProcessInfo
from towers.cluster.torchrun import read_master

__all__ = ["LocalEnvironment"]


class LocalEnvironment(ClusterEnvironment):
    """A single local process; honours ``MASTER_ADDR``/``MASTER_PORT`` and ``TOWERS_STRATEGY`` when set."""

    name = "single"

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Return True: a single process is always possible."""
        return True

    def process_info(self, environ: Mapping[str, str]) -> ProcessInfo:
        """Return rank 0 of 1 on this host."""
        master_addr, master_port = read_master(environ)
        strategy, num_ps = launch_options(environ)
        return ProcessInfo(master_addr=master_addr, master_port=master_port, source=self.name,
                           strategy=strategy, num_ps=num_ps)
