"""The torchft lighthouse of a job under ``--strategy fault_tolerant``: run on node 0 by its launcher, found at a
known port by the other nodes."""

from __future__ import annotations

import contextlib
import ipaddress
from typing import Any, Mapping

from towers._logging import get_logger
from towers.launch.errors import LaunchError
from towers.launch.spawn import free_port
from towers.launch.spec import LaunchSpec

__all__ = ["DEFAULT_LIGHTHOUSE_PORT", "checked_peer_timeout_s", "job_lighthouse"]

log = get_logger("towers.launch.launcher")  # the records keep the name they had in launcher.py

#: Port of the fault-tolerant job's lighthouse on node 0 across nodes (``TOWERS_LIGHTHOUSE_PORT`` changes it);
#: on one node it is a free port.
DEFAULT_LIGHTHOUSE_PORT = 29510


def checked_peer_timeout_s(spec: LaunchSpec) -> float:
    from towers.launch.lighthouse import DEFAULT_PEER_TIMEOUT_S

    value = spec.strategy_options.get("peer_timeout_s", DEFAULT_PEER_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise LaunchError(f"--strategy-option peer_timeout_s must be a positive number of seconds. Received: {value!r}. "
                          "Example: --strategy-option peer_timeout_s=5.", exit_code=2)
    return float(value)


@contextlib.contextmanager
def job_lighthouse(spec: LaunchSpec, environ: Mapping[str, str]) -> Any:
    """Yield the lighthouse address a fault-tolerant job's workers use, running the lighthouse here on node 0.

    None is yielded when the job names its own (``TORCHFT_LIGHTHOUSE``, ``--strategy-option lighthouse=``).
    On one node the lighthouse gets a free port of ``--master-addr``; across nodes it listens on node 0's
    ``--master-addr`` at ``TOWERS_LIGHTHOUSE_PORT`` (default 29510), where the other nodes look for it.

    Raises:
        LaunchError: when torchft is missing, the port is not a number, or the lighthouse cannot start.
    """
    if spec.strategy_options.get("lighthouse") or environ.get("TORCHFT_LIGHTHOUSE", "").strip():
        yield None
        return
    text = environ.get("TOWERS_LIGHTHOUSE_PORT", "").strip()
    if spec.is_single_node and not text:
        port = free_port(spec.master_addr)
    else:
        try:
            port = int(text or DEFAULT_LIGHTHOUSE_PORT)
            if not 0 < port < 65536:
                raise ValueError
        except ValueError:
            raise LaunchError(f"TOWERS_LIGHTHOUSE_PORT must be a port number in 1..65535. Received: {text!r}. "
                              f"Unset it for {DEFAULT_LIGHTHOUSE_PORT}.", exit_code=2) from None
    host = spec.master_addr.strip("[]")
    url_host = f"[{host}]" if ":" in host else host
    if spec.node_rank != 0:  # node 0 runs it
        yield f"http://{url_host}:{port}"
        return
    from towers.launch.lighthouse import start_lighthouse
    from towers.network import NetworkError, resolve_ipv4

    peer_timeout_s = checked_peer_timeout_s(spec)
    try:
        bind = host if ":" in host else resolve_ipv4(host)
        if spec.interface:
            from towers.network import find_interface

            bind = find_interface(spec.interface).address or bind
        elif not spec.is_single_node and ipaddress.ip_address(bind).is_loopback:
            bind = "0.0.0.0"  # this host maps its own name to loopback (Debian's 127.0.1.1): listen where others reach
        lighthouse = start_lighthouse(bind, port, peer_timeout_s=peer_timeout_s)
    except ImportError as exc:
        raise LaunchError(str(exc), exit_code=2) from None
    except NetworkError as exc:
        raise LaunchError(f"--master-addr {spec.master_addr}: {exc}", exit_code=2) from None
    except Exception as exc:  # torchft's bind error (a RuntimeError from its Rust side)
        raise LaunchError(f"The job's torchft lighthouse could not start on {host}:{port}: {type(exc).__name__}: "
                          f"{exc}. Pick another port (TOWERS_LIGHTHOUSE_PORT) or start one yourself and pass "
                          "--strategy-option lighthouse=http://HOST:PORT.", exit_code=2) from None
    log.info("fault-tolerant job: lighthouse on %s:%d (peer_timeout_s=%s)", host, port, peer_timeout_s)
    try:
        yield f"http://{url_host}:{port}"
    finally:
        lighthouse.shutdown()
