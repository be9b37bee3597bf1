"""Where a replica group of FaultTolerantStrategy listens: its store on the group's own address only.

Process 0 of each group serves the group's ``TCPStore`` (torchft's managers and per-quorum Gloo
groups meet there). torch's server would listen on every interface, IPv4 and IPv6; handed a socket
bound to the group's address (``towers.cluster.rendezvous.bound_listener``, as the rendezvous store
of ``towers launch`` and ``init_process_group`` is), it listens there only: loopback on one host,
the job's interface across hosts. A group reached over loopback binds its Gloo sockets to loopback
too (``towers.network.use_loopback``). torchft's manager server is the exception: it binds
``[::]`` itself (see docs/fault_tolerance.md, "What a group listens on").
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

from towers._logging import get_logger
from towers.cluster.rendezvous import bound_listener
from towers.network import use_loopback

__all__ = ["group_store", "is_loopback"]

log = get_logger(__name__)


def is_loopback(host: str) -> bool:
    """True when ``host`` (a name or an address) resolves to a loopback address (False when it does not resolve)."""
    try:
        address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        return ipaddress.ip_address(str(address).split("%")[0]).is_loopback
    except (OSError, UnicodeError, ValueError, IndexError):
        return False


def group_store(host: str, port: int, *, serves: bool, timeout_s: float) -> Any:
    """Return the group's ``TCPStore``: its server (``serves``) listening on ``host``'s address only, else a client.

    ``port`` 0 lets the server pick a free one (read it from ``store.port``). A group reached over
    loopback also makes its Gloo groups bind loopback. When ``host`` is not an address of this host,
    or ``port`` is taken, the server is made as torch makes it (every interface; torch then reports a
    taken port with its own message).
    """
    from torch.distributed import TCPStore

    if is_loopback(host):
        use_loopback()  # before the first Gloo group: torch reads GLOO_SOCKET_IFNAME when it makes one
    timeout = timedelta(seconds=timeout_s)
    try:
        listener = bound_listener(host, port) if serves else None
        if serves and listener is None:
            log.info("the replica group's store listens on every interface: %s is not an address of this host", host)
    except OSError:  # the port is taken: torch's own bind says so, with its message
        listener = None
    if listener is None:
        return TCPStore(host_name=host, port=port, is_master=serves, wait_for_workers=False, timeout=timeout)
    fd, address = listener
    try:
        return TCPStore(host_name=address, port=port, is_master=True, wait_for_workers=False, timeout=timeout,
                        master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
