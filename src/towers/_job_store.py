"""The job's key-value store, as ``init_process_group`` joins it: reachability checked and waits reported
(``towers.cluster.rendezvous``), every rank recorded, keys private to the restart attempt, and the chief's server
bound to the rendezvous address."""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
import time
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

from towers._logging import get_logger
from towers.cluster.deaths import StartupWatch, pid_scope
from towers.cluster.info import ProcessInfo
from towers.cluster.rendezvous import (
    Member,
    RendezvousError,
    bound_listener,
    join,
    resolve,
    visible_warning,
    wait_reachable,
)

__all__ = ["join_store", "rank_tag", "rendezvous_source", "rendezvous_store", "rendezvous_store_at", "store_client",
           "store_listener"]

log = get_logger("towers.process_group")  # the records keep the name they had in process_group.py


def rank_tag(info: ProcessInfo) -> str:
    return f"[rank {info.rank}/{info.world_size}]"


def store_client(info: ProcessInfo, host: str) -> dist.Store:
    # A client of its own for the watch's thread: the main thread's may be held in a long store wait.
    store = dist.TCPStore(host, int(info.master_port), world_size=info.world_size,  # type: ignore[arg-type]
                          is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
    return dist.PrefixStore(f"towers/attempt_{info.restart_count}", store)


def rendezvous_source(info: ProcessInfo) -> str:
    return {"tf_config": "TF_CONFIG's chief address", "slurm": "MASTER_ADDR or the first SLURM node",
            "kubeflow_trainer": "PET_MASTER_ADDR/PET_MASTER_PORT"}.get(info.source, "MASTER_ADDR/MASTER_PORT")


def join_store(info: ProcessInfo, timeout_s: float, since: float, watch: StartupWatch, *,
               source_address: str | None = None) -> dist.Store:
    """Return the job's key-value store once every rank has joined, keys private to this restart attempt.

    Under torchrun the agent's store outlives a failed attempt. Without a per-attempt prefix a
    restarted rank can read a peer's address from the dead attempt and fail to connect.
    ``source_address`` is the chosen interface's address: reachability is checked from it. ``watch``
    learns every member that joined, and a death it sees ends the wait.
    """
    port = int(info.master_port)  # type: ignore[arg-type]  # init_method raised if it was None
    what = rendezvous_source(info)
    hosts_store = info.rank == 0 and not info.agent_store
    started = time.monotonic()
    report = visible_warning(log, prefix=f"{rank_tag(info)} towers:")
    if hosts_store:
        resolve(info.master_addr, port, what=what)  # the others would fail on it: say so here too
        address = source_address or ""
    else:
        owner = "torchrun's agent" if info.agent_store else f"the chief, {info.describe_rank(0)},"
        address = wait_reachable(info.master_addr, port, timeout_s=info.join_timeout_s, what=what, awaited=owner,
                                 report=report, since=since, source_address=source_address)
    prefixed, client_host = rendezvous_store_at(info, timeout_s)
    watch.set_store_factory(lambda: store_client(info, client_host))
    # A process that leaves the group and joins again may find its old store alive (a module still holds the
    # old group): each join of this process gets its own keys; every rank joins as often as the others.
    global _JOINED
    _JOINED = next(_JOIN_COUNT)
    joins = dist.PrefixStore(f"join_{_JOINED}", prefixed)

    def dead(joined: Mapping[int, Member]) -> str | None:
        watch.watch(joined)
        return watch.failure

    members = join(joins, index=info.rank, count=info.world_size, is_chief=info.rank == 0,
                   timeout_s=info.join_timeout_s, where=f"{info.master_addr}:{port}", describe=info.describe_rank,
                   report=report, me=Member(host=socket.gethostname(), address=address, pid=os.getpid(),
                                            scope=pid_scope()),
                   since=since, waited_s=min(time.monotonic() - started, info.join_timeout_s - 1.0), dead=dead)
    watch.watch(members)
    return prefixed


_JOIN_COUNT = itertools.count()
_JOINED = 0  # the index of this process's last join (0: its first)


def group_store(store: dist.Store) -> dist.Store:
    """The store a process group is made on: a later join's group gets keys of its own, since torch numbers a new
    group as it numbered the destroyed one and would read the old group's addresses from the same store."""
    return store if _JOINED == 0 else dist.PrefixStore(f"group_{_JOINED}", store)


def rendezvous_store(info: ProcessInfo, timeout_s: float) -> dist.Store:
    """Return the job's key-value store, with keys private to this restart attempt (see ``_join``)."""
    return rendezvous_store_at(info, timeout_s)[0]


def rendezvous_store_at(info: ProcessInfo, timeout_s: float) -> tuple[dist.Store, str]:
    """Return ``rendezvous_store``'s store and the host its client reached it at (a second client goes there)."""
    hosts_store = info.rank == 0 and not info.agent_store
    port = int(info.master_port)  # type: ignore[arg-type]
    if hosts_store and port in _SERVERS:  # a later join of this process: the server it already runs
        store, host = _SERVERS[port]
        return dist.PrefixStore(f"towers/attempt_{info.restart_count}", store), host
    listener = store_listener(info, port) if hosts_store else None
    if listener is not None:  # the server listens on the rendezvous address only, and the chief's client goes there
        fd, host = listener
        try:
            store = dist.TCPStore(host, port, world_size=info.world_size, is_master=True,
                                  timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True,
                                  master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
    else:
        # The chief's own client reaches its server over loopback; the server listens on every interface.
        host = "127.0.0.1" if hosts_store else info.master_addr
        store = dist.TCPStore(
            host,
            port,
            world_size=info.world_size,
            is_master=hosts_store,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    if hosts_store:
        _SERVERS[port] = (store, host)
    return dist.PrefixStore(f"towers/attempt_{info.restart_count}", store), host


#: The store servers this process runs, by port, kept for its lifetime: a strategy built after another's shutdown
#: joins on the same server. Were it stopped with the first group, a peer still joining through it (its own shutdown
#: done sooner) would lose its connection mid-join; each join and group has keys of its own (``join_``, ``group_``).
_SERVERS: dict[int, tuple[dist.TCPStore, str]] = {}


def store_listener(info: ProcessInfo, port: int) -> tuple[int, str] | None:
    """Return the chief's store socket bound to the rendezvous address (see ``bound_listener``), or None.

    None (torch's server on every interface) when the address is not this host's, or when it is a
    loopback address of a job that spans hosts without a chosen interface (a host name this host maps to
    127.0.1.1 that the other hosts resolve through their DNS).
    """
    try:
        address = ipaddress.ip_address(resolve(info.master_addr, port, what="MASTER_ADDR")[0].split("%")[0])
    except (RendezvousError, ValueError):
        return None
    if address.is_loopback and info.world_size > info.local_world_size and not info.interface:
        return None
    try:
        return bound_listener(info.master_addr, port)
    except OSError:
        return None  # in use: torch's own bind reports it as before, with its message
