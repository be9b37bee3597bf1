"""A parameter-server job's start: the links every worker / ps task pair opens, and a ps task serving on them."""

from __future__ import annotations

from typing import Any, Callable

from towers._logging import get_logger
from towers.checkpoint.preemption import PREEMPTED_EXIT_CODE, ServingPreemptionHandler, preemption_signals
from towers.cluster.deaths import StartupWatch
from towers.cluster.info import ProcessInfo
from towers.cluster.launch_notes import note_started
from towers.process_group import DistributedError, init_process_group, startup_watch
from towers.strategies.parameter_server import transport
from towers.strategies.parameter_server.roles import Roles
from towers.strategies.parameter_server.server import ParameterServer

__all__ = ["open_links", "connect_links", "serve_links"]

log = get_logger("towers.strategies.parameter_server.strategy")  # the records keep the name they had in strategy.py


def open_links(roles: Roles, info: ProcessInfo, *, timeout_s: float,
               before_links: Callable[[], None]) -> list[transport.Link]:
    """Join the job's process group, run ``before_links`` (collectives every rank joins before the ps tasks serve),
    then open this process's links (``connect_links``).

    Until every link is up, a process that dies is named by the others at once: the job cannot start without it (a
    dead worker's batches are handed over only once the ps tasks serve). From then on the launcher's supervisor lets
    the job go on without a worker.

    Raises:
        DistributedError: joining or connecting failed.
    """
    watch = startup_watch(info)
    try:
        init_process_group(info, backend="gloo", timeout_s=timeout_s, watch=watch)
        watch.set_phase("running the collectives before the parameter-server links")
        before_links()
        links = connect_links(roles, info, timeout_s=timeout_s, watch=watch)
    except BaseException:
        watch.stop()
        raise
    watch.finish(transport.rendezvous_store())
    if info.launch_dir:
        note_started(info.launch_dir, rank=info.rank)
    return links


def connect_links(roles: Roles, info: ProcessInfo, *, timeout_s: float, watch: StartupWatch) -> list[transport.Link]:
    """Open this process's links: a worker's to every ps task, a ps task's to every worker.

    Raises:
        DistributedError: a link could not be opened (naming the process that died, when one did).
    """
    store, generation, r = transport.rendezvous_store(), transport.next_generation(), roles
    # One fixed global order of pairs (worker-major) so that no two processes wait on each other.
    pairs = ([(w, r.index) for w in range(r.num_workers)] if r.is_ps
             else [(r.index, p) for p in range(r.num_ps)])
    links = []
    for w, p in pairs:
        name = f"worker {w} (rank {w}) <-> ps task {p} (rank {r.ps_ranks[p]})"
        watch.set_phase(f"connecting {name}")
        try:
            links.append(transport.open_link(store, worker=w, ps=p, is_ps=r.is_ps, bind_host=r.bind_host,
                                             timeout_s=timeout_s, generation=generation, name=name))
        except transport.LinkError as exc:
            if watch.failure is not None:
                raise DistributedError(f"[rank {info.rank}/{info.world_size}] {watch.failure}") \
                    from None
            raise DistributedError(f"[rank {info.rank}/{info.world_size}] connecting {name} failed: "
                                   f"{exc}. Check that every process of the job started and uses the same "
                                   "num_ps.") from exc
    return links


def serve_links(links: list[transport.Link], roles: Roles, info: ProcessInfo, *, mode: str, staleness: int | None,
                timeout_s: float, shared_memory: bool, exit_on_ps: bool) -> tuple[dict[str, Any], int | None]:
    """Serve the workers on ``links`` (this process is a ps task) until they are done; close the links.

    Returns the server's stats and the step the workers saved at on a preemption notice (None: none came).

    Raises:
        DistributedError: the job failed while serving.
    """
    server = ParameterServer(links, ps_index=roles.index, rank=info.rank,
                             worker_ranks=list(range(roles.num_workers)), mode=mode,
                             staleness=staleness, timeout_s=timeout_s, num_ps=roles.num_ps,
                             shared_memory=shared_memory, ledger_dir=info.ledger_dir)
    # A preemption notice must not end this process before the workers saved: their checkpoint fetches
    # the state that lives here. It goes to the workers through the store; this process serves on.
    signals = preemption_signals(info.preemption_signals)
    preemption = ServingPreemptionHandler(signals=signals, rank=info.rank)
    preemption.install()
    log.info("ps task %d (rank %d) serving %d worker(s), mode %s", roles.index, info.rank,
             roles.num_workers, mode)
    try:
        stats = server.serve()
    except RuntimeError as exc:
        preemption.finish()  # a notice of its own nobody saved on is delivered again
        # The links stay open: a hung worker's thread may still be blocked in one of them.
        raise DistributedError(f"[rank {info.rank}/{info.world_size}] ps task {roles.index} "
                               f"stops: {exc}") from exc
    preempted_at = preemption.finish()
    if preempted_at is not None:
        stats["preempted_at_step"] = preempted_at
        log.warning("ps task %d: the workers saved at step %d on a preemption notice; %s", roles.index,
                    preempted_at, "exiting for a restart" if exit_on_ps
                    else f"exit with code {PREEMPTED_EXIT_CODE} for a restart")
    for link in links:
        link.close()
    log.info("ps task %d done: %d update(s) applied, worker versions %s", roles.index,
             stats["version"], stats["worker_versions"])
    return stats, preempted_at
