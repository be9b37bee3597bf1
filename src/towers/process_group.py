"""Start and stop ``torch.distributed`` with a timeout and errors that name the rank and the operation."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from towers._logging import get_logger, set_rank
from towers.cluster.info import ProcessInfo
from towers.network import use_interface

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedError",
    "choose_backend",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "collective",
    "first_line",
]

log = get_logger(__name__)

#: How long any collective or the rendezvous may block before the job fails (seconds).
#: torch's own default is 30 minutes; a dead or hung peer should be noticed sooner.
DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RuntimeError):
    """A process-group operation failed; the message names this rank and the operation."""


def choose_backend(local_world_size: int, cuda_device_count: int | None = None) -> str:
    """Return ``"nccl"`` when every local replica has its own GPU and NCCL is built, else ``"gloo"``."""
    if cuda_device_count is None:
        from towers.devices import gpu_count

        cuda_device_count = gpu_count()
    if cuda_device_count >= local_world_size > 0 and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _rank_tag(info: ProcessInfo) -> str:
    return f"[rank {info.rank}/{info.world_size}]"


def init_process_group(
    info: ProcessInfo, *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S
) -> str:
    """Join this process to the job's default process group and return the backend used.

    A no-op (returning the current backend) when the group already exists.

    Across hosts, Gloo/NCCL bind the interface ``towers.network.use_interface`` picks (the one
    named by ``info.interface``, else the one that routes to the other hosts).

    Raises:
        ValueError: on a bad backend or timeout; ``towers.network.NetworkError`` when no usable
            interface can be chosen.
        DistributedError: when the rendezvous fails or times out; the message names this rank,
            the rendezvous address and what to check.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds. Received: {timeout_s}.")
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise ValueError(
            f"backend must be 'auto', 'gloo', 'nccl' or 'mpi'. Received: {backend!r}. "
            "Use 'auto' to pick NCCL on GPU hosts and Gloo otherwise.")
    set_rank(info.rank, info.world_size)
    if dist.is_initialized():
        return str(dist.get_backend())
    if backend == "auto":
        backend = choose_backend(info.local_world_size)
    if backend == "nccl":
        # Each replica owns cuda:<local_rank>; NCCL needs it selected before the first collective.
        torch.cuda.set_device(info.local_rank)
    init_method = info.init_method
    if backend in ("gloo", "nccl"):
        use_interface(info)  # before the group exists: torch reads GLOO/NCCL_SOCKET_IFNAME when it makes one
    log.debug("joining process group: backend=%s init_method=%s timeout_s=%s", backend, init_method, timeout_s)
    try:
        dist.init_process_group(
            backend,
            store=_rendezvous_store(info, timeout_s),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as exc:  # torch raises several types (DistNetworkError, DistStoreError, RuntimeError)
        hint = (
            f"Another program may be using port {info.master_port}: pick a free one with --master-port."
            if "address already in use" in str(exc).lower()
            else f"Check that all {info.world_size} processes were started, that "
            f"{info.master_addr}:{info.master_port} is reachable from this host, or raise timeout_s."
        )
        raise DistributedError(
            f"{_rank_tag(info)} could not join the process group ({backend}) at {init_method} "
            f"within {timeout_s:g} s: {first_line(exc)}. {hint}") from exc
    log.info("joined process group: backend=%s world_size=%d", backend, info.world_size)
    return backend


def _rendezvous_store(info: ProcessInfo, timeout_s: float) -> dist.Store:
    """Return the job's key-value store, with keys private to this restart attempt.

    Under torchrun the agent's store outlives a failed attempt. Without a per-attempt prefix a
    restarted rank can read a peer's address from the dead attempt and fail to connect.
    """
    store = dist.TCPStore(
        info.master_addr,
        int(info.master_port),  # type: ignore[arg-type]  # init_method above raised if it was None
        world_size=info.world_size,
        is_master=info.rank == 0 and not info.agent_store,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )
    return dist.PrefixStore(f"towers/attempt_{info.restart_count}", store)


def destroy_process_group() -> None:
    """Leave the default process group if this process is in one (idempotent)."""
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
