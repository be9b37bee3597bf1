"""Nodes of a multi-node ``towers launch`` finding each other: visibly, within the join timeout, failing fast.

torchrun's static rendezvous waits silently (its store's timeout, 15 minutes by default, and more
on the way). So before torchrun's agent starts, ``joined_nodes`` runs towers' own join on the
same store: node 0 opens the store at the rendezvous address (torchrun's agent then shares that
server: both are multi-tenant stores on one port), every node records itself (node rank, host,
address, pid), and node 0 reports every ~15 s which nodes joined and which are missing, and stops
the job at the join timeout with one line saying so; the other nodes stop with the same line. A
node whose rendezvous host does not resolve or cannot be reached stops at once.

Under a dynamic rendezvous (``--rdzv-backend c10d``, elastic node counts) torchrun decides who
belongs to the job; towers checks only that the rendezvous host resolves and answers, and bounds
torchrun's own wait by the join timeout (``join_timeout``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

from towers._logging import get_logger
from towers.cluster.rendezvous import Member, bound_listener, join, resolve, wait_reachable
from towers.errors import InvalidArgumentError
from towers.launch.spec import LaunchSpec

__all__ = ["rendezvous_address", "joined_nodes", "rendezvous_timeouts", "open_store", "DEFAULT_C10D_PORT"]

log = get_logger(__name__)

#: torchrun's port for an ``--rdzv-endpoint`` without one under a dynamic rendezvous.
DEFAULT_C10D_PORT = 29400


def rendezvous_address(spec: LaunchSpec) -> tuple[str, int, str]:
    """Return ``(host, port, flag)`` of the rendezvous, ``flag`` naming where it came from (for messages).

    Raises:
        ValueError: when ``--rdzv-endpoint`` is not ``HOST[:PORT]`` or no port is known.
    """
    if spec.rdzv_endpoint:
        text = spec.rdzv_endpoint.strip()
        host, sep, port_text = text.rpartition(":") if not text.endswith("]") else (text, "", "")
        if not sep:
            host, port_text = text, ""
        host = host.strip("[]")
        if port_text and not port_text.isdigit():
            raise InvalidArgumentError(f"--rdzv-endpoint must be HOST:PORT. Received: {text!r}. Example: --rdzv-endpoint "
                                       "node0.example.com:29500.")
        port = int(port_text) if port_text else (DEFAULT_C10D_PORT if spec.rdzv_backend != "static" else 0)
        if not host or not 0 < port < 65536:
            raise InvalidArgumentError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535. Received: {text!r}. "
                                       "Example: --rdzv-endpoint node0.example.com:29500.")
        return host, port, "--rdzv-endpoint"
    if spec.master_port is None:
        raise InvalidArgumentError("No rendezvous port is known. Pass --master-port (or --rdzv-endpoint HOST:PORT).")
    return spec.master_addr, spec.master_port, "--master-addr/--master-port"


def rendezvous_timeouts(spec: LaunchSpec, join_timeout_s: float) -> dict[str, int]:
    """Return the ``rdzv_configs`` entries that bound torchrun's own rendezvous wait by the join timeout.

    A value the user passed with ``--rdzv-conf`` is kept.
    """
    given = {item.split("=", 1)[0].strip() for item in str(spec.torchrun_options.get("rdzv_conf") or "").split(",")
             if "=" in item}
    key = "timeout" if spec.rdzv_backend == "static" else "join_timeout"
    return {} if key in given else {key: max(1, round(join_timeout_s))}


def open_store(host: str, port: int, *, timeout_s: float, bind: bool = True) -> Any:
    """Return a multi-tenant ``TCPStore`` server on ``host:port`` that listens on ``host``'s address only.

    torch's server listens on every interface unless handed a bound socket; when ``host`` is not an
    address of this host (``bound_listener`` returns None), or ``bind`` is False, torch's default is kept.
    """
    import torch.distributed as dist

    listener = bound_listener(host, port) if bind else None
    if listener is None:
        log.info("the rendezvous store listens on every interface: %s is not an address of this host", host)
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                             timeout=timedelta(seconds=timeout_s))
    fd, address = listener
    try:
        return dist.TCPStore(address, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _is_local_address(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def joined_nodes(spec: LaunchSpec, *, join_timeout_s: float, report: Callable[[str], None]) -> Iterator[None]:
    """Return (as a context) once every node of ``spec`` joined; the store stays open inside the context.

    A single-node job under the static rendezvous opens the store bound to ``--master-addr``
    (loopback by default; torchrun's agent shares it) and does not wait; other single-node jobs
    return at once.

    Raises:
        towers.cluster.rendezvous.RendezvousError: (one line) when the rendezvous host does not resolve
            or answer, or nodes are still missing at ``join_timeout_s``.
        ValueError: when the rendezvous address is malformed, or ``spec.interface`` is not an interface
            of this host (``towers.network.NetworkError``).
    """
    if spec.is_single_node:
        if spec.rdzv_backend != "static" or spec.master_port is None:
            yield
            return
        # torchrun's agent would open the store on every interface; opened here first, bound to the
        # rendezvous address (loopback), the agent's multi-tenant store shares this server instead.
        store = open_store(spec.master_addr, spec.master_port, timeout_s=join_timeout_s)
        try:
            yield
        finally:
            del store
        return
    host, port, flag = rendezvous_address(spec)
    since, started = time.time(), time.monotonic()
    source_address = None
    if spec.interface:  # towers launch --interface: the attempts leave from that interface
        from towers.network import find_interface

        source_address = find_interface(spec.interface).address
    if spec.rdzv_backend != "static":
        addresses = resolve(host, port, what=flag)
        if not any(_is_local_address(a) for a in addresses):
            wait_reachable(host, port, timeout_s=join_timeout_s, what=flag, awaited="the node that hosts it",
                           report=report, since=since, source_address=source_address)
        yield
        return
    import torch.distributed as dist

    hosts_store = spec.node_rank == 0
    if hosts_store:
        address = source_address or resolve(host, port, what=flag)[0]
    else:
        address = wait_reachable(host, port, timeout_s=join_timeout_s, what=flag,
                                 awaited="node 0 (towers launch --node-rank 0)", report=report, since=since,
                                 source_address=source_address)
    if hosts_store:
        # A host name that this host maps to loopback (Debian's 127.0.1.1) may still be how the other nodes
        # reach it through their DNS: only then does the store keep listening on every interface.
        store = open_store(address, port, timeout_s=join_timeout_s,
                           bind=bool(source_address) or not ipaddress.ip_address(address.split("%")[0]).is_loopback)
    else:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, multi_tenant=True,
                              timeout=timedelta(seconds=join_timeout_s))
    join(dist.PrefixStore(f"towers/launch/{spec.rdzv_id}", store), index=spec.node_rank, count=spec.max_nodes,
         is_chief=hosts_store, timeout_s=join_timeout_s, where=f"{host}:{port}", describe=lambda i: f"node {i}",
         report=report, me=Member(host=socket.gethostname(), address=address, pid=os.getpid()), kind="node",
         since=since, waited_s=min(time.monotonic() - started, join_timeout_s - 1.0))
    try:
        yield  # node 0's server must outlive torchrun's rendezvous on it
    finally:
        del store
