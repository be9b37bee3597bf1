"""Which network interface a job's links use: the one named, or the one that routes to the other hosts.

Gloo and NCCL take their interface from ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``. Without
them Gloo binds the address this host's *name* resolves to, and Debian maps the host name to
127.0.1.1 in ``/etc/hosts``: the other hosts are then told to connect to their own loopback. So a
job that spans hosts needs one interface for every link (the rendezvous store is reached at
``master_addr``; Gloo/NCCL collectives and the parameter-server links bind the interface's address):

1. the one named by ``towers launch --interface`` / ``TOWERS_INTERFACE`` / ``GLOO_SOCKET_IFNAME``
   (``ProcessInfo.interface``);
2. else, when the job spans hosts, the interface whose address the kernel uses to reach a peer
   host (the rendezvous address, and every TF_CONFIG address), never loopback: when every peer
   name resolves to this host, the default route's interface, else the only non-loopback one;
3. else (one host) nothing is set, and torch keeps its default.

IPv4 only; interfaces are listed with Linux ``ioctl`` calls (no extra dependency). Only
``towers.cluster`` writes the chosen name into the environment (``export_interface``).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

from towers._logging import get_logger
from towers.cluster.info import ProcessInfo
from towers.errors import TowersError

__all__ = [
    "NetworkError",
    "Interface",
    "InterfaceChoice",
    "list_interfaces",
    "find_interface",
    "resolve_ipv4",
    "route_to",
    "default_route_interface",
    "choose_interface",
    "peer_hosts",
    "spans_hosts",
    "interface_for",
    "use_interface",
    "use_loopback",
]

log = get_logger(__name__)

_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8
_HINT = "Pass --interface NAME to towers launch (or set TOWERS_INTERFACE=NAME) on every host"


class NetworkError(TowersError, ValueError):
    """An interface or address cannot be used; the message says what was received and what to do."""


@dataclass(frozen=True)
class Interface:
    """One network interface of this host: its name, IPv4 address (None when it has none) and state."""

    name: str
    address: str | None = None
    prefix_length: int | None = None
    is_up: bool = True
    is_loopback: bool = False

    def contains(self, address: str) -> bool:
        """True when ``address`` is this interface's address or lies in its subnet (loopback: 127/8)."""
        if self.address is None:
            return False
        if address == self.address:
            return True
        if not self.is_loopback or self.prefix_length is None:
            return False
        network = ipaddress.ip_network(f"{self.address}/{self.prefix_length}", strict=False)
        return ipaddress.ip_address(address) in network

    def __str__(self) -> str:
        where = f"{self.address}/{self.prefix_length}" if self.address else "no IPv4 address"
        state = ", ".join(s for s in ("loopback" if self.is_loopback else "", "" if self.is_up else "down") if s)
        return f"{self.name} ({where}{', ' + state if state else ''})"


@dataclass(frozen=True)
class InterfaceChoice:
    """The interface a process uses and why (``"given"``, ``"routes to hostb (10.0.0.2)"``, ...)."""

    interface: Interface
    reason: str

    @property
    def name(self) -> str:
        """The interface's name, as ``GLOO_SOCKET_IFNAME`` takes it."""
        return self.interface.name


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    import fcntl

    return fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))


def list_interfaces() -> list[Interface]:
    """Return this host's interfaces with their IPv4 address and state (empty where that cannot be read)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                flags = struct.unpack("H", _ioctl(sock, _SIOCGIFFLAGS, name)[16:18])[0]
            except (OSError, ImportError):
                continue  # vanished meanwhile, or not Linux
            address = prefix = None
            try:
                address = socket.inet_ntoa(_ioctl(sock, _SIOCGIFADDR, name)[20:24])
                mask = socket.inet_ntoa(_ioctl(sock, _SIOCGIFNETMASK, name)[20:24])
                prefix = ipaddress.ip_network(f"0.0.0.0/{mask}").prefixlen
            except OSError:
                pass  # no IPv4 address
            found.append(Interface(name, address, prefix, bool(flags & _IFF_UP), bool(flags & _IFF_LOOPBACK)))
    return found


def _names(interfaces: Sequence[Interface]) -> str:
    return ", ".join(str(i) for i in interfaces) or "none could be listed"


def find_interface(name: str, interfaces: Sequence[Interface] | None = None) -> Interface:
    """Return the interface called ``name`` (the first of a comma-separated ``GLOO_SOCKET_IFNAME`` list).

    Raises:
        NetworkError: when there is no such interface, it is down, or it has no IPv4 address.
    """
    interfaces = list_interfaces() if interfaces is None else interfaces
    wanted = name.split(",")[0].strip()
    if not interfaces:  # cannot be listed here (not Linux): trust the name, as Gloo will check it
        return Interface(wanted)
    for interface in interfaces:
        if interface.name == wanted:
            if not interface.is_up or interface.address is None:
                raise NetworkError(f"Interface {wanted!r} cannot carry the job's links: {interface}. "
                                   f"Bring it up with an IPv4 address, or pick another: {_names(interfaces)}.")
            return interface
    raise NetworkError(f"No network interface called {wanted!r} on this host (--interface / TOWERS_INTERFACE / "
                       f"GLOO_SOCKET_IFNAME). This host has: {_names(interfaces)}. Pass one of those names.")


def resolve_ipv4(host: str) -> str:
    """Return the first IPv4 address ``host`` resolves to here (a literal address is returned as is).

    Raises:
        NetworkError: when the name does not resolve to an IPv4 address.
    """
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise NetworkError(f"Host name {host!r} does not resolve to an IPv4 address on this host ({exc}). "
                           "Check the name, /etc/hosts or DNS, or use the peer's IP address.") from None
    return str(infos[0][4][0])


def route_to(host: str) -> tuple[str, str]:
    """Return ``(address of host, source address this host uses to reach it)``; no packet is sent.

    Raises:
        NetworkError: when the host does not resolve or no route leads to it.
    """
    address = resolve_ipv4(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))  # a UDP "connect" only asks the kernel for a route
        except OSError as exc:
            raise NetworkError(f"No route from this host to {host} ({address}): {exc.strerror}. Check the "
                               "address and this host's routes (ip route).") from None
        return address, str(sock.getsockname()[0])


def default_route_interface(route_table: str = "/proc/net/route") -> str | None:
    """Return the interface of this host's IPv4 default route, or None (no default route, or not Linux)."""
    try:
        with open(route_table, encoding="ascii") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    for row in rows:
        if len(row) > 7 and row[1] == "00000000" and row[7] == "00000000" and int(row[3], 16) & 0x1:
            return row[0]
    return None


def choose_interface(peers: Sequence[str], *, remote_peers: bool, interfaces: Sequence[Interface] | None = None,
                     route: Callable[[str], tuple[str, str]] = route_to,
                     default_route: str | None | Callable[[], str | None] = default_route_interface) -> InterfaceChoice:
    """Return the interface whose address reaches ``peers`` (host names or addresses), in their order.

    With ``remote_peers`` (the job spans hosts) loopback is never chosen: when every peer resolves
    to this host, the default route's interface is, else the only up non-loopback interface with an
    IPv4 address.

    Raises:
        NetworkError: when no such interface can be told apart; the message lists the candidates.
    """
    interfaces = list_interfaces() if interfaces is None else list(interfaces)
    problems, local = [], []
    for host in dict.fromkeys(peers):
        try:
            address, source = route(host)
        except NetworkError as exc:
            problems.append(str(exc))
            continue
        holder = next((i for i in interfaces if i.contains(source)), None)
        if holder is None:
            continue
        if not holder.is_loopback:
            return InterfaceChoice(holder, f"routes to {host} ({address})")
        local.append(f"{host} -> {address}")
    loopback = next((i for i in interfaces if i.is_loopback and i.address), None)
    if not remote_peers:
        if loopback is None:
            raise NetworkError(f"This host has no loopback interface with an IPv4 address: {_names(interfaces)}.")
        return InterfaceChoice(loopback, "every process of the job runs on this host")
    why = f"{', '.join(local)} (this host)" if local else "no peer address is known"
    candidates = [i for i in interfaces if i.is_up and not i.is_loopback and i.address]
    default = default_route() if callable(default_route) else default_route
    for interface in candidates:
        if interface.name == default:
            return InterfaceChoice(interface, f"the default route's interface; {why}")
    if len(candidates) == 1:
        return InterfaceChoice(candidates[0], f"the only non-loopback interface; {why}")
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise NetworkError(
        f"Cannot tell which interface reaches the other hosts of the job: {why}{detail}, and this host has "
        f"{len(candidates)} candidate interface(s): {_names(candidates)}. {_HINT}.")


def spans_hosts(info: ProcessInfo) -> bool:
    """True when some process of the job runs on another host."""
    return info.world_size > info.local_world_size


def peer_hosts(info: ProcessInfo) -> tuple[str, ...]:
    """Return the hosts this process talks to: the rendezvous address, then every other TF_CONFIG task's host."""
    hosts = [info.master_addr]
    mine = info.cluster.addresses(info.task.type)[info.task.index:info.task.index + 1]
    for addresses in info.cluster.jobs.values():
        hosts.extend(a.rsplit(":", 1)[0].strip("[]") for a in addresses if a not in mine)
    return tuple(dict.fromkeys(h for h in hosts if h))


def interface_for(info: ProcessInfo, *, interfaces: Sequence[Interface] | None = None) -> InterfaceChoice | None:
    """Return the interface this process's links use, or None on a one-host job without one named.

    Raises:
        NetworkError: when the named interface is unusable, or none can be chosen (see ``choose_interface``).
    """
    interfaces = list_interfaces() if interfaces is None else interfaces
    # TF_CONFIG lists every peer: when all of them resolve to this host, the job runs on this host.
    every_peer_known = bool(info.cluster.jobs)
    if info.interface:
        given = find_interface(info.interface, interfaces)
        if given.is_loopback and spans_hosts(info) and (not every_peer_known or not choose_interface(
                peer_hosts(info), remote_peers=False, interfaces=interfaces).interface.is_loopback):
            raise NetworkError(f"Interface {given} is loopback, but the job spans hosts: the others cannot reach "
                               f"{given.address}. Name the interface that reaches them (this host has: "
                               f"{_names(interfaces)}), or leave it out to have it detected.")
        return InterfaceChoice(given, "given (--interface / TOWERS_INTERFACE / GLOO_SOCKET_IFNAME)")
    if not spans_hosts(info):
        return None
    choice = choose_interface(peer_hosts(info), remote_peers=not every_peer_known, interfaces=interfaces)
    return None if choice.interface.is_loopback else choice


def use_interface(info: ProcessInfo) -> InterfaceChoice | None:
    """Choose this process's interface (``interface_for``) and make its Gloo/NCCL groups bind it.

    Call before the first process group is made: torch reads ``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME`` when it creates a group. Returns the choice (None: torch's default).

    Raises:
        NetworkError: as ``interface_for``.
    """
    from towers.cluster.environ import export_interface

    choice = interface_for(info)
    if choice is not None:
        export_interface(choice.name)
        log.info("network interface %s (%s): %s", choice.name, choice.interface.address, choice.reason)
    return choice


def use_loopback() -> None:
    """Make this process's Gloo/NCCL groups bind the loopback interface (a job on one host).

    Without it they bind the address of the host name, which in a container or on a cloud host is
    the address other machines reach. A value the user set (``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``) wins; nothing is set on a host without an up loopback interface.
    """
    from towers.cluster.environ import export_interface

    loopback = next((i for i in list_interfaces() if i.is_loopback and i.is_up), None)
    if loopback is not None:
        export_interface(loopback.name, collectives_only=True)
