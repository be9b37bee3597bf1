"""Checks before a launch starts any process: the rendezvous port chosen and free, the script there."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket

from towers.launch.errors import LaunchError
from towers.launch.spawn import free_port
from towers.launch.spec import LaunchSpec

__all__ = ["DEFAULT_MULTI_NODE_PORT", "preflight", "resolve_ports"]

#: torchrun's rendezvous port across nodes when none is given.
DEFAULT_MULTI_NODE_PORT = 29500


def resolve_ports(spec: LaunchSpec) -> LaunchSpec:
    """Return ``spec`` with its rendezvous port chosen: a free loopback port on one node, 29500 across nodes."""
    if spec.master_port is not None or spec.rdzv_backend != "static" or spec.rdzv_endpoint:
        return spec
    port = free_port(spec.master_addr) if spec.is_single_node else DEFAULT_MULTI_NODE_PORT
    return dataclasses.replace(spec, master_port=port)


def _check_script(spec: LaunchSpec) -> None:
    if spec.module:
        if not all(part.isidentifier() for part in spec.script.split(".")):
            raise LaunchError(f"-m/--module expects a dotted module name such as 'pkg.train'. Received: "
                              f"{spec.script!r}. Drop -m to run a file.", exit_code=2)
        return
    if spec.no_python and not spec.run_path:
        if shutil.which(spec.script) is None:
            raise LaunchError(
                f"--no-python runs {spec.script!r} directly, but no such executable was found (on PATH or as a "
                "path). Check the name, make the file executable, or drop --no-python for a Python script.",
                exit_code=2)
        return
    if not os.path.isfile(spec.script):
        hint = " It is a directory; name the .py file inside it." if os.path.isdir(spec.script) else ""
        raise LaunchError(
            f"Training script not found: {spec.script!r} (looked in {os.getcwd()}).{hint} Pass the path of a "
            "Python file, `-m pkg.module` for a module, or `--no-python` for an executable.", exit_code=2)


def _check_port(spec: LaunchSpec) -> None:
    # Node 0 of a static rendezvous binds master_addr:master_port; a busy port would otherwise
    # surface as a DistNetworkError from deep inside the agent.
    if spec.rdzv_backend != "static" or spec.node_rank != 0 or spec.master_port is None:
        return
    family = socket.AF_INET6 if ":" in spec.master_addr.strip("[]") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((spec.master_addr.strip("[]"), spec.master_port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"Port {spec.master_port} on {spec.master_addr} is already in use, so the rendezvous cannot start "
                "there. Pick another --master-port, or omit it on a single node to get a free one.",
                exit_code=2) from None
        # Not an address of this host (or not resolvable here): node 0 is elsewhere; nothing to check.


def preflight(spec: LaunchSpec) -> None:
    """Check, before starting any process, that the script exists and the rendezvous port is free.

    Raises:
        LaunchError: naming what is missing or busy and how to fix it.
    """
    _check_script(spec)
    _check_port(spec)
    if spec.node_rank == 0:  # node 0 hosts the job's store: one connection per process of the job
        from towers.launch.limits import check_host_limits

        check_host_limits(spec.nproc_per_node * spec.max_nodes)
