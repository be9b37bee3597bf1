"""Two simulated hosts for tests: network namespaces joined by a veth pair (root only).

Host ``hosta`` is 10.77.0.1 on its veth end, ``hostb`` 10.77.0.2; the addresses live only inside
the namespaces. A process runs "on" a host under ``ip netns exec`` with that host's name
(``unshare --uts``) and a private ``/etc/hosts`` (``unshare --mount`` + a bind mount). With
``loopback_names`` (the default) each host's own name resolves to 127.0.1.1 on that host, as
Debian sets it up; otherwise both names resolve to the veth addresses everywhere.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

_COUNTER = itertools.count()


@dataclass(frozen=True)
class Host:
    """One simulated host: a network namespace, its veth end and address, its name and /etc/hosts."""

    name: str
    netns: str
    interface: str
    address: str
    hosts_file: Path
    shm_dir: Path

    def command(self, argv: list[str]) -> list[str]:
        """Return ``argv`` run on this host: in its namespace, with its host name, /etc/hosts and /dev/shm."""
        shell = ('hostname "$1" && mount --bind "$2" /etc/hosts && mount --bind "$3" /dev/shm && shift 3 '
                 '&& exec "$@"')
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "sh", "-c", shell, "sh",
                self.name, str(self.hosts_file), str(self.shm_dir), *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns, veth) needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def host_pair_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., tuple[Host, Host]]:
    """Return ``make(loopback_names=True) -> (hosta, hostb)`` for a fixture; the namespaces go with the test.

    Skips the test (with the reason) without root, Linux, ``ip`` or ``unshare``.
    """
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    created: list[str] = []

    def cleanup() -> None:
        for netns in created:  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=20)

    request.addfinalizer(cleanup)

    def make(loopback_names: bool = True) -> tuple[Host, Host]:
        tag = f"{os.getpid() % 10**6}x{next(_COUNTER)}"
        names, addresses = ("hosta", "hostb"), ("10.77.0.1", "10.77.0.2")
        netns = [f"towers-test-{tag}{s}" for s in "ab"]
        veth = [f"tw{tag}{s}" for s in "ab"]
        try:
            for ns in netns:
                _ip("netns", "add", ns)
                created.append(ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a network namespace here: {exc.stderr.strip()}")
        _ip("link", "add", veth[0], "netns", netns[0], "type", "veth", "peer", "name", veth[1], "netns", netns[1])
        hosts = []
        for i in range(2):
            _ip("-n", netns[i], "link", "set", "lo", "up")
            _ip("-n", netns[i], "addr", "add", f"{addresses[i]}/24", "dev", veth[i])
            _ip("-n", netns[i], "link", "set", veth[i], "up")
            other = 1 - i
            lines = ["127.0.0.1 localhost"]
            if loopback_names:  # Debian's way: this host's own name is 127.0.1.1 here
                lines += [f"127.0.1.1 {names[i]}", f"{addresses[other]} {names[other]}"]
            else:
                lines += [f"{addresses[j]} {names[j]}" for j in range(2)]
            hosts_file = tmp_path / f"hosts.{names[i]}.{tag}"
            hosts_file.write_text("\n".join(lines) + "\n")
            shm_dir = tmp_path / f"shm.{names[i]}.{tag}"  # each host its own shared memory, as apart hosts have
            shm_dir.mkdir(mode=0o1777)
            hosts.append(Host(names[i], netns[i], veth[i], addresses[i], hosts_file, shm_dir))
        return hosts[0], hosts[1]

    return make


