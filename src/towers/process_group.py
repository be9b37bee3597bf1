"""Start and stop ``torch.distributed`` with a timeout and errors that name the rank and the operation.

Joining is visible and bounded (``towers.cluster.rendezvous``): a rank that does not host the
store first checks that the rendezvous host resolves and answers (one line at once if not; while
the port refuses connections, its owner has not started, and the rank waits, saying so); then
every rank records itself in the store and the chief reports every ~15 s who joined and who is
missing, up to ``ProcessInfo.join_timeout_s``. From its record until the group exists (or, with a
``startup_watch`` the caller ends, until its own connections are up) a rank that dies is named by
the others at once (``towers.cluster.deaths``). torch's own text for a failure (C++ frames
included) goes to a log file named in the one-line error. A process that joined leaves the group
at interpreter exit (``atexit``), so a script that never calls ``shutdown`` still exits cleanly.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from towers._job_store import group_store as _group_store
from towers._job_store import join_store as _join
from towers._job_store import rank_tag as _rank_tag
from towers._job_store import rendezvous_store as _rendezvous_store  # noqa: F401 - towers.process_group._rendezvous_store
from towers._job_store import store_client as _store_client
from towers._logging import configure_logging, configured_logging, get_logger, set_rank
from towers.cluster.deaths import StartupWatch, publish_death
from towers.cluster.info import ProcessInfo
from towers.cluster.ray import RAY_SOURCE
from towers.cluster.rendezvous import (
    RendezvousError,
    visible_warning,
)
from towers.diagnostics import enable_flight_recorder, start_watchdog, stop_watchdog
from towers.errors import InvalidArgumentError, TowersError
from towers.network import spans_hosts, use_interface, use_loopback

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedError",
    "choose_backend",
    "init_process_group",
    "init_one_process_group",
    "startup_watch",
    "announce_death",
    "announce_deaths",
    "destroy_process_group",
    "leave_before_exit",
    "is_initialized",
    "collective",
    "first_line",
    "details_path",
]

log = get_logger(__name__)

#: How long any collective or the rendezvous may block before the job fails (seconds).
#: torch's own default is 30 minutes; a dead or hung peer should be noticed sooner.
DEFAULT_TIMEOUT_S = 300.0


class DistributedError(TowersError, RuntimeError):
    """A process-group operation failed; the message names this rank and the operation."""


def choose_backend(local_world_size: int, cuda_device_count: int | None = None) -> str:
    """Return ``"nccl"`` when every local replica has its own GPU and NCCL is built, else ``"gloo"``."""
    if cuda_device_count is None:
        from towers.devices import gpu_count

        cuda_device_count = gpu_count()
    if cuda_device_count >= local_world_size > 0 and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def startup_watch(info: ProcessInfo) -> StartupWatch:
    """Return a ``StartupWatch`` for this process: pass it to ``init_process_group``, ``finish`` it once start-up is over.

    Under it, a rank that dies before start-up ends (e.g. before a strategy's own connections
    are up) makes this process fail at once naming that rank, instead of waiting out a timeout.
    """
    return StartupWatch(index=info.rank, count=info.world_size, describe=info.describe_rank,
                        report=visible_warning(log, prefix=f"{_rank_tag(info)} towers:"),
                        report_death=visible_warning(log, prefix=f"{_rank_tag(info)} towers:", level=logging.ERROR),
                        store_factory=None, timeout_s=info.join_timeout_s)  # the store: once _join made it


def announce_death(info: ProcessInfo, description: str) -> None:
    """Tell the processes of ``info``'s job still in start-up that rank ``info.rank`` died (``description``: how).

    Called by the process's supervisor, which outlives it; the others stop at once naming the rank.

    Raises:
        RuntimeError: the job's store cannot be reached (torch's ``DistStoreError`` and kin).
    """
    publish_death(_store_client(info, info.master_addr), info.rank, description)


def announce_deaths(master_addr: str, master_port: int, deaths: Mapping[int, str], *, attempt: int) -> None:
    """Tell the processes of restart ``attempt`` of the job whose store is at ``master_addr:master_port`` that
    ranks died (``deaths``: rank -> how); those still in start-up stop at once naming the rank (``towers launch``).

    Raises:
        RuntimeError: the job's store cannot be reached (torch's ``DistStoreError`` and kin).
    """
    store = dist.PrefixStore(f"towers/attempt_{attempt}", dist.TCPStore(
        master_addr, master_port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False))
    for rank, description in deaths.items():
        publish_death(store, rank, description)


def init_process_group(
    info: ProcessInfo, *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
    watch: StartupWatch | None = None,
) -> str:
    """Join this process to the job's default process group and return the backend used.

    A no-op (returning the current backend) when the group already exists. ``watch`` (from
    ``startup_watch``) names a rank that dies during start-up; the caller finishes it. Without one,
    this call watches until the group exists.

    Across hosts, Gloo/NCCL bind the interface ``towers.network.use_interface`` picks (the one
    named by ``info.interface``, else the one that routes to the other hosts).

    Raises:
        ValueError: on a bad backend or timeout; ``towers.network.NetworkError`` when no usable
            interface can be chosen.
        DistributedError: when the rendezvous fails or times out; the message names this rank,
            the rendezvous address and what to check, or the rank that died during start-up.
    """
    if timeout_s <= 0:
        raise InvalidArgumentError(f"timeout_s must be > 0 seconds. Received: {timeout_s}.")
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise InvalidArgumentError(
            f"backend must be 'auto', 'gloo', 'nccl' or 'mpi'. Received: {backend!r}. "
            "Use 'auto' to pick NCCL on GPU hosts and Gloo otherwise.")
    set_rank(info.rank, info.world_size)
    if info.log_level and not configured_logging():  # a worker of `towers launch`: its [rank r/w] output
        configure_logging(info.log_level)
    if dist.is_initialized():
        return str(dist.get_backend())
    if info.source == RAY_SOURCE:
        # Ray's rank 0 hosts the store at MASTER_PORT: a group of towers' own there would be a second one.
        raise DistributedError(
            f"{_rank_tag(info)} this Ray worker has no torch process group. towers builds on the one Ray Train's "
            "torch backend makes before the training function runs. Received: a Ray worker with RANK/WORLD_SIZE set "
            "but no group. Run the function in ray.train.torch.TorchTrainer (not a plain Ray task or another "
            "trainer), with its default TorchConfig.")
    if backend == "auto":
        backend = choose_backend(info.local_world_size)
    if backend == "nccl":
        # Each replica owns cuda:<local_rank>; NCCL needs it selected before the first collective.
        torch.cuda.set_device(info.local_rank)
    init_method = info.init_method
    choice = None
    if backend in ("gloo", "nccl"):
        choice = use_interface(info)  # before the group exists: torch reads GLOO/NCCL_SOCKET_IFNAME when it makes one
        if choice is None and not spans_hosts(info):
            use_loopback()  # loopback is all a one-host job's Gloo/NCCL sockets need
    log.debug("joining process group: backend=%s init_method=%s timeout_s=%s join_timeout_s=%s", backend,
              init_method, timeout_s, info.join_timeout_s)
    started, since = time.monotonic(), time.time()
    own_watch = watch is None
    watch = watch or startup_watch(info)
    try:
        try:
            store = _join(info, timeout_s, since, watch, source_address=choice.interface.address if choice else None)
        except RendezvousError as exc:
            raise DistributedError(f"{_rank_tag(info)} {exc}") from None
        enable_flight_recorder(info)  # torch's record of every collective, read by the stuck-job watchdog
        excepthook = sys.excepthook
        watch.set_phase(f"creating the process group ({backend}) of {info.world_size} processes")
        try:
            dist.init_process_group(backend, store=_group_store(store), rank=info.rank, world_size=info.world_size,
                                    timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises several types (DistNetworkError, DistStoreError, RuntimeError)
            if watch.failure is not None:
                raise DistributedError(f"{_rank_tag(info)} {watch.failure}") from None
            raise _init_error(info, backend, exc, time.monotonic() - started) from None
        if watch.failure is not None:
            raise DistributedError(f"{_rank_tag(info)} {watch.failure}")
    except BaseException:
        watch.stop(wait_s=2.0)  # this thread reports the failure: the watch must not end the process later
        raise
    if own_watch:
        watch.finish(store)
    if info.log_level is not None:
        # Under `towers launch` every output line already starts with "[rank N]: ": torch's hook would
        # prefix a script's traceback a second time ("[rank 0]: [rank0]: Traceback ...").
        sys.excepthook = excepthook
    _leave_at_exit()
    start_watchdog(info)  # ends the job with a report naming the stuck rank (towers.diagnostics)
    log.info("joined process group: backend=%s world_size=%d", backend, info.world_size)
    return backend


def details_path(rank: int) -> str:
    """Return the file where this process writes the full text of a failure (torch's C++ frames included)."""
    return os.path.join(tempfile.gettempdir(), "towers-logs", f"rank{rank}-pid{os.getpid()}.log")


def _write_details(info: ProcessInfo, exc: BaseException) -> str | None:
    path = details_path(info.rank)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {info.rank}/{info.world_size}\n")
            fh.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path


def _init_error(info: ProcessInfo, backend: str, exc: BaseException, elapsed_s: float) -> DistributedError:
    text = str(exc).lower()
    if "address already in use" in text:
        hint = f"Another program may be using port {info.master_port}: pick a free one with --master-port."
    elif "connection refused" in text or "connect" in text or "no route" in text:
        hint = ("Every rank joined the rendezvous, so the store is reachable; the ranks' own connections failed. "
                "Each process advertises the address of its host name (Debian maps it to 127.0.1.1, which other "
                "hosts cannot reach): choose the network interface with towers launch --interface NAME or "
                "GLOO_SOCKET_IFNAME=NAME (NCCL_SOCKET_IFNAME on GPUs) on every host.")
    else:
        hint = f"Check that all {info.world_size} processes run the same job and can reach each other."
    path = _write_details(info, exc)
    where = f" (torch's full message: {path})" if path else ""
    return DistributedError(
        f"{_rank_tag(info)} could not create the process group ({backend}) at {info.init_method} after "
        f"{elapsed_s:.1f} s: {first_line(exc)}. {hint}{where}")


_LEAVE_REGISTERED = False


def init_one_process_group(device: torch.device, *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Make a process group of this process alone; return True when this call made it (False: one exists already).

    For a one-process job whose torch code needs a group all the same (FSDP2 on one GPU). Nothing is
    awaited and no port is opened: the group's store lives in this process. The backend is NCCL for a
    CUDA ``device`` (when torch has it), else Gloo. Left at exit like the job's group.

    Raises:
        ValueError: on a bad backend or timeout.
    """
    if timeout_s <= 0:
        raise InvalidArgumentError(f"timeout_s must be > 0 seconds. Received: {timeout_s}.")
    if backend not in ("auto", "gloo", "nccl"):
        raise InvalidArgumentError(f"backend must be 'auto', 'gloo' or 'nccl'. Received: {backend!r}.")
    if dist.is_initialized():
        return False
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    _leave_at_exit()
    log.info("made a process group of this process alone: backend=%s", backend)
    return True


#: How long the exit hook lets Gloo's worker threads finish with their last work (see ``leave_before_exit``).
_EXIT_DRAIN_S = 0.05


def _leave_at_exit() -> None:
    # atexit runs in reverse order of registration, so whatever registered after the group (a strategy's
    # shutdown) runs before the group is destroyed.
    global _LEAVE_REGISTERED
    if not _LEAVE_REGISTERED:
        atexit.register(leave_before_exit)
        _LEAVE_REGISTERED = True


def leave_before_exit() -> None:
    """Destroy the default process group (if any) while the interpreter is whole, and let Gloo's threads finish.

    Called at exit for a group towers joined; ``towers verify`` calls it for a group a user's script left open.
    """
    # A script that never calls shutdown must still exit 0. Without this, interpreter teardown sometimes
    # aborted ("terminate called without an active exception"): a Gloo worker thread (ProcessGroupGloo::
    # runLoop) drops its last finished all-reduce right after the work completes, and that releases the
    # tensors' Python objects, which needs the GIL; once finalization has begun, the thread is made to
    # exit while unwinding a noexcept destructor, and the process aborts. So: destroy the group while the
    # interpreter is whole, then release the GIL a moment so that a thread in that window finishes first.
    # (A module such as DDP may still hold the group, so its threads can outlive the destroy.)
    destroy_process_group()
    time.sleep(_EXIT_DRAIN_S)


def destroy_process_group() -> None:
    """Leave the default process group if this process is in one (idempotent)."""
    stop_watchdog()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        set_rank(0, 1)  # later log lines of this process no longer belong to that job


def is_initialized() -> bool:
    """True when this process has joined a default process group."""
    return dist.is_available() and dist.is_initialized()


def first_line(exc: BaseException) -> str:
    """Return the first line of ``exc``'s message, without Gloo's ``[file:line]`` prefix."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line.split("] ", 1)[-1] if line.startswith("[") else line


@contextlib.contextmanager
def collective(operation: str) -> Iterator[None]:
    """Run a block of collectives; a torch failure becomes a ``DistributedError`` naming rank and operation."""
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as exc:
        rank = dist.get_rank() if is_initialized() else 0
        world = dist.get_world_size() if is_initialized() else 1
        raise DistributedError(
            f"[rank {rank}/{world}] {operation} failed: {first_line(exc)}. "
            "Another process of the job probably died or hung; look for the first error in the "
            "other ranks' output. This process stops here.") from exc
