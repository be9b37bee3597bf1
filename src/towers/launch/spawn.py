"""``towers.spawn``: run a Python function on N local processes, torchrun-style, with a deadline.

Each child gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, …) so code inside it finds its place with ``towers.cluster.from_env()`` exactly
as under ``towers launch``. The parent owns the deadline: on the first failure, or when time
runs out, it ends every child and raises ``SpawnError`` showing each rank's state.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Sequence

from towers._logging import get_logger
from towers.errors import InvalidArgumentError, InvalidTypeError, TowersError

__all__ = ["spawn", "SpawnError", "RankState", "free_port", "cpu_threads_per_process"]

log = get_logger(__name__)

try:  # functions defined in a notebook or a test body travel by value when cloudpickle is present
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = pickle  # type: ignore[assignment]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def cpu_threads_per_process(nprocs: int, cores: int | None = None) -> int:
    """Return how many intra-op threads each of ``nprocs`` CPU replicas gets, so they do not oversubscribe."""
    if nprocs < 1:
        raise InvalidArgumentError(f"nprocs must be >= 1. Received: {nprocs}.")
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nprocs)


@dataclass(frozen=True)
class RankState:
    """What one child reported: ``status`` is ``ok``, ``error``, ``died``, ``running`` or ``stopped``."""

    rank: int
    status: str
    detail: str = ""


class SpawnError(TowersError, RuntimeError):
    """A spawned job failed or ran out of time; ``states`` holds every rank's final state."""

    def __init__(self, message: str, states: Sequence[RankState]):
        super().__init__(message)
        self.states = tuple(states)


def _watch_parent(parent_pid: int) -> None:
    # A child must not outlive the process that owns its deadline (e.g. a killed pytest run).
    while True:
        if os.getppid() != parent_pid:
            os._exit(70)
        time.sleep(0.5)


def _child(rank: int, nprocs: int, env: Mapping[str, str], threads: int, payload: bytes,
           conn: Connection, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(threads)
        fn, args, kwargs = _pickler.loads(payload)
        result = fn(*args, **kwargs)
        try:
            message = ("ok", _pickler.dumps(result))
        except Exception as exc:  # the result must travel back to the parent
            message = ("error", f"rank {rank} returned a value that cannot be pickled: {exc!r}")
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        message = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(message)
    finally:
        conn.close()
    try:
        from towers.process_group import destroy_process_group

        destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already reported
        pass
    # Skip interpreter teardown: a finished child need not wait on library threads.
    os._exit(0 if message[0] == "ok" else 1)


def _stop(procs: Sequence[mp.process.BaseProcess], grace_s: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            p.join(5.0)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 300.0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    threads_per_process: int | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local processes and return their results in rank order.

    Each child gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), so
    ``towers.strategy_from_env()`` inside ``fn`` builds the strategy of an ``nprocs``-process job.

    Args:
        fn: the function each process runs; sent to the children by pickling, so defined at a module's top
            level (or anything ``cloudpickle`` can send, when it is installed).
        nprocs: how many processes (ranks) to start, at least 1.
        args: positional arguments for ``fn``, the same on every rank.
        kwargs: keyword arguments for ``fn``, the same on every rank.
        timeout_s: the deadline for the whole run, in seconds; past it every child is killed.
        master_addr: the address of the rendezvous (``MASTER_ADDR``).
        master_port: its port (``MASTER_PORT``). Default: a free port.
        env: variables added to every child's environment (e.g. ``{"TOWERS_STRATEGY": "mirrored"}``).
        threads_per_process: torch's intra-op threads per child (``OMP_NUM_THREADS``). Default: this
            machine's cores shared among the children.

    Returns:
        What ``fn`` returned on each rank, in rank order.

    Raises:
        ValueError: on a bad ``nprocs`` or ``timeout_s``.
        TypeError: when ``fn`` or its arguments cannot be sent to a child process.
        SpawnError: when a rank fails, dies, or the deadline passes; the message shows every rank.

    Example:
        <!-- not-run: the children import fn by reference, so it must live in a script or module file -->
        ```python
        import towers

        def replica_id() -> int:
            return towers.strategy_from_env().replica_id

        if __name__ == "__main__":
            print(towers.spawn(replica_id, 2, env={"TOWERS_STRATEGY": "mirrored"}))  # [0, 1]
        ```
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgumentError(f"nprocs must be a positive integer. Received: {nprocs!r}.")
    if timeout_s <= 0:
        raise InvalidArgumentError(f"timeout_s must be > 0 seconds. Received: {timeout_s}.")
    try:
        payload = _pickler.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise InvalidTypeError(
            f"towers.spawn could not send {getattr(fn, '__qualname__', fn)!r} and its arguments to child "
            f"processes: {exc}. Define the function at module top level (or install cloudpickle) and pass "
            "picklable arguments.") from exc
    port = master_port or free_port(master_addr)
    threads = threads_per_process or cpu_threads_per_process(nprocs)
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    readers: dict[Connection, int] = {}
    try:
        for rank in range(nprocs):
            child_env = {
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(rank),
                "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs),
                "GROUP_RANK": "0", "NODE_RANK": "0", "OMP_NUM_THREADS": str(threads), **dict(env or {}),
            }
            reader, writer = ctx.Pipe(duplex=False)
            readers[reader] = rank
            p = ctx.Process(target=_child, args=(rank, nprocs, child_env, threads, payload, writer, os.getpid()),
                            name=f"towers-rank-{rank}", daemon=False)
            p.start()
            writer.close()
            procs.append(p)
        return _collect(procs, readers, timeout_s)
    finally:  # also when starting a later child failed: no child outlives this call
        _stop(procs)
        for reader in readers:
            reader.close()


def _collect(procs: Sequence[mp.process.BaseProcess], readers: dict[Connection, int], timeout_s: float) -> list[Any]:
    nprocs = len(procs)
    deadline = time.monotonic() + timeout_s
    states: dict[int, RankState] = {}
    results: dict[int, Any] = {}
    pending = dict(readers)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    while len(states) < nprocs:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready = wait([*pending, *(s for s, r in sentinels.items() if r not in states)], timeout=remaining)
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                try:
                    status, body = obj.recv()
                except (EOFError, OSError):
                    continue  # no report: the sentinel tells how it ended
                if status == "ok":
                    results[rank] = _pickler.loads(body)
                    states[rank] = RankState(rank, "ok")
                else:
                    states[rank] = RankState(rank, "error", body)
            elif isinstance(obj, int) and obj in sentinels:
                rank = sentinels[obj]
                reader = next((c for c, r in pending.items() if r == rank), None)
                if reader is not None and reader.poll(0.5):
                    continue  # a report is waiting; read it on the next pass
                if rank not in states:
                    procs[rank].join(1.0)
                    states[rank] = RankState(rank, "died", f"exited with code {procs[rank].exitcode} before reporting")
                    if reader is not None:
                        pending.pop(reader, None)
        if any(s.status != "ok" for s in states.values()):
            break
    if len(states) == nprocs and all(s.status == "ok" for s in states.values()):
        return [results[r] for r in range(nprocs)]
    timed_out = time.monotonic() >= deadline
    for rank in range(nprocs):
        if rank not in states:
            states[rank] = RankState(rank, "running" if timed_out else "stopped",
                                     f"still running at the {timeout_s:g} s deadline" if timed_out
                                     else "stopped after another rank failed")
    ordered = [states[r] for r in range(nprocs)]
    failed = [s for s in ordered if s.status in ("error", "died")]
    lines = [f"  rank {s.rank}: {s.status}" + (f": {s.detail.splitlines()[0]}" if s.detail else "") for s in ordered]
    if failed:
        head = f"towers.spawn: rank {failed[0].rank} of {nprocs} failed; the other ranks were stopped."
        tail = f"\nrank {failed[0].rank} traceback:\n{failed[0].detail}" if failed[0].status == "error" else ""
    else:
        head = (f"towers.spawn: the job did not finish within timeout_s={timeout_s:g} s; every rank was stopped. "
                "A rank may be blocked in a collective another rank never entered, or the work needs a longer timeout_s.")
        tail = ""
    raise SpawnError("\n".join([head, *lines]) + tail, ordered)
