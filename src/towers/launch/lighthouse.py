"""torchft's lighthouse, the quorum server of fault-tolerant replica groups: started by ``towers launch`` or by hand.

It lives with launching (``towers launch --strategy fault_tolerant`` runs one on node 0), and the
strategy only takes its address: launch/ never imports a strategy.
"""

from __future__ import annotations

import contextlib
from typing import Any

from towers._logging import get_logger
from towers.errors import user_error

__all__ = ["Lighthouse", "start_lighthouse", "DEFAULT_PEER_TIMEOUT_S", "check_timeout"]

log = get_logger(__name__)

#: Default of ``peer_timeout_s``: the longest a live group waits for a lost one.
DEFAULT_PEER_TIMEOUT_S = 3.0


def check_timeout(name: str, value: float) -> float:
    """Return ``value`` as seconds, or raise naming ``name`` when it is not a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise user_error(f"{name} must be a positive number of seconds", f"{name}={value!r}", f"Use e.g. {name}=5.")
    return float(value)


def _lighthouse_server() -> Any:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        raise ImportError(f"The lighthouse runs on torchft, which could not be imported. Received: {type(exc).__name__}: "
                          f"{exc}. Install the optional extra: pip install 'towers[ft]' (torchft>=0.2, which needs "
                          "torch>=2.7).") from exc
    return LighthouseServer


class Lighthouse:
    """A running torchft lighthouse: ``address`` (``"http://host:port"``, what the strategies take) and ``shutdown()``."""

    def __init__(self, server: Any, host: str) -> None:
        self._server = server
        port = int(str(server.address()).rsplit(":", 1)[1])
        self.address = f"http://{host}:{port}"

    def shutdown(self) -> None:
        """Stop the lighthouse (idempotent); groups still training then fail their next quorum."""
        with contextlib.suppress(Exception):
            self._server.shutdown()


def start_lighthouse(address: str = "127.0.0.1", port: int = 0, *, min_replicas: int = 1,
                     peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> Lighthouse:
    """Start torchft's lighthouse (the quorum server) in this process, bound to ``address:port``; return it.

    It runs on threads of this process until ``shutdown()`` (or the process ends). ``port=0``
    picks a free port. A group that sends no heartbeat for ``peer_timeout_s`` is left out of the
    next quorum, and a quorum waits at most as long for a live group that has not joined yet.
    ``min_replicas`` groups are needed for any quorum (keep 1 so that one survivor trains on).
    Give the strategies ``lighthouse=lighthouse.address``.
    """
    LighthouseServer = _lighthouse_server()
    timeout_ms = int(check_timeout("peer_timeout_s", peer_timeout_s) * 1000)
    host = f"[{address}]" if ":" in address else address
    server = LighthouseServer(bind=f"{host}:{int(port)}", min_replicas=int(min_replicas), join_timeout_ms=timeout_ms,
                              quorum_tick_ms=20, heartbeat_timeout_ms=timeout_ms)
    lighthouse = Lighthouse(server, host)
    log.info("torchft lighthouse on %s (min_replicas=%d, peer_timeout_s=%s)", lighthouse.address, min_replicas,
             peer_timeout_s)
    return lighthouse
