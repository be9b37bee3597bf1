"""The host limits a large job meets first, checked by ``towers launch`` on the node that hosts the job's store.

Every process of the job keeps one connection to the rendezvous store (torch's TCPStore) on node 0,
so that node needs an open-file limit above the job's process count, and a listen backlog
(``net.core.somaxconn``) that does not refuse the burst of connections at start-up. Neither shows
on a small job; on one of thousands of ranks they fail start-up with errors that do not name them
("Too many open files", connection resets and retries).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Callable

from towers._logging import get_logger

__all__ = ["HostLimits", "read_limits", "check_host_limits"]

log = get_logger(__name__)

#: Open files a process needs besides the store's connections (libraries, logs, loader workers, sockets).
SPARE_FILES = 1024


class HostLimits:
    """This host's open-file limits (soft, hard) and listen backlog (None where unknown)."""

    def __init__(self, files_soft: int, files_hard: int, somaxconn: int | None):
        self.files_soft, self.files_hard, self.somaxconn = files_soft, files_hard, somaxconn


def read_limits(somaxconn_path: str = "/proc/sys/net/core/somaxconn") -> HostLimits:
    """Read this host's limits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        backlog: int | None = int(Path(somaxconn_path).read_text().strip())
    except (OSError, ValueError):
        backlog = None
    infinity = resource.RLIM_INFINITY
    return HostLimits(soft if soft != infinity else 1 << 30, hard if hard != infinity else 1 << 30, backlog)


def check_host_limits(world_size: int, *, limits: HostLimits | None = None,
                      raise_soft: Callable[[int], None] | None = None) -> list[str]:
    """Check the store host's limits for ``world_size`` processes; return the warnings (also logged).

    An open-file soft limit below ``world_size + SPARE_FILES`` is raised up to the hard limit (this
    process's children inherit it); what remains short is warned about, with the command that fixes it.
    """
    limits = limits or read_limits()
    needed = world_size + SPARE_FILES
    warnings = []
    if limits.files_soft < needed:
        target = min(needed, limits.files_hard)
        if target > limits.files_soft:
            (raise_soft or _raise_soft)(target)
            log.info("open-file limit raised from %d to %d for the store's %d connections", limits.files_soft, target,
                     world_size)
            limits.files_soft = target
        if limits.files_soft < needed:
            warnings.append(
                f"the job's {world_size} processes each keep a connection to the store on this node, but its open-file "
                f"limit is {limits.files_soft} (hard {limits.files_hard}): start-up will fail with 'Too many open files'. "
                f"Raise it to at least {needed} (ulimit -n {needed}, or LimitNOFILE= / the container's nofile ulimit).")
    if limits.somaxconn is not None and limits.somaxconn < world_size:
        warnings.append(
            f"net.core.somaxconn is {limits.somaxconn}, below the job's {world_size} processes that connect to the store "
            f"on this node at once: connections may be refused and retried, slowing start-up. Raise it "
            f"(sysctl -w net.core.somaxconn={max(4096, world_size)}).")
    for line in warnings:
        log.warning("%s", line)
    return warnings


def _raise_soft(target: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
