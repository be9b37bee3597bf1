"""A ps task: hold one shard of the parameters and its optimizer, apply the workers' gradients.

One thread per worker link, blocked in ``recv``, handles that worker's requests in order. All
shard state sits behind one condition variable:

* ``async``: each pushed gradient is applied on arrival (``optimizer.step()`` on the shard); the
  reply sends the shard as it is then (no snapshot copy: with several workers it may include part
  of a concurrent update, as async parameter servers usually allow).
  With ``staleness=s`` a push waits while its worker already has more than ``s`` applied
  updates beyond the slowest other live worker.
* ``sync``: pushes of one round are summed; the last arrival applies one step for all.

A worker on the same host offers shared memory at registration (``shared.py``); once mapped, its
pushes carry only a header (the gradients are read where the worker wrote them) and the
parameters of a reply are copied into the worker's file instead of sent.

Workers that said goodbye or died stop counting for rounds, staleness and gathers. A dead
worker is logged and the others go on, in both modes: a sync round applies the pushes of the
live workers, and ps task 0 hands the dead worker's batches to them (``dispatch.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import torch

from towers._logging import get_logger
from towers.diagnostics import set_role
from towers.errors import FailedPreconditionError
from towers.ledger.record import LedgerWriter
from towers.strategies.parameter_server.dispatch import Dispatcher
from towers.strategies.parameter_server.gather import GatherTable
from towers.strategies.parameter_server.generations import ModelTurnover
from towers.strategies.parameter_server.requests import (
    RequestError,
    clone_state,
    report_kernels,
    use_fast_kernels,
)
from towers.strategies.parameter_server.shard_updates import ShardUpdates, flat_values
from towers.strategies.parameter_server.sharding import FlatLayout, ParamSpec
from towers.strategies.parameter_server.shared import SharedBuffer
from towers.strategies.parameter_server.sparse_server import EmbeddingService
from towers.strategies.parameter_server.transport import (
    LISTEN_TIMEOUT_S,
    Link,
    LinkError,
    Message,
    Op,
    ProtocolError,
    Status,
)
from towers.strategies.parameter_server.tree_round import TreeRound

__all__ = ["ParameterServer"]

log = get_logger(__name__)


class ParameterServer(ShardUpdates):
    """Serve one shard to every worker until all of them said goodbye or died."""

    def __init__(self, links: Sequence[Link], *, ps_index: int, rank: int, worker_ranks: Sequence[int], mode: str,
                 staleness: int | None, timeout_s: float, num_ps: int = 1, shared_memory: bool = True,
                 ledger_dir: str | None = None):
        self.links, self.ps_index, self.rank = list(links), ps_index, rank
        set_role("ps")  # the stuck-job watchdog: a ps serves, so it is never the one that waits
        self.worker_ranks, self.mode, self.staleness, self.timeout_s = list(worker_ranks), mode, staleness, timeout_s
        n = len(self.links)
        self.cond = threading.Condition()
        self.failure: str | None = None
        self.dead: dict[int, str] = {}
        self.finished: set[int] = set()
        self.worker_versions = [0] * n
        self.version = 0
        self.max_lead = 0
        self.gathers = GatherTable(self.cond, self.active)
        # shard state, set by the chief's registration
        self.signature: list[ParamSpec] | None = None
        self.generation = 0  # which of the job's models (a later strategy.prepare registers the next one)
        self.turnover = ModelTurnover(self)  # the latest model each worker registered
        self.layout: FlatLayout | None = None
        self.segment_sizes: list[int] = []
        self.params_buf = torch.empty(0, dtype=torch.uint8)
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.grad_bufs: dict[int, torch.Tensor] = {}
        self.reply_bufs: dict[int, torch.Tensor] = {}
        self.shared_memory = shared_memory
        #: per worker on this host: its (gradient, parameter) files, mapped at registration
        self.shared: dict[int, tuple[SharedBuffer, SharedBuffer]] = {}
        # sync rounds
        self.round = 0
        self.arrivals: set[int] = set()
        self.present: list[bool] = []
        self.sum_buf = torch.empty(0, dtype=torch.uint8)
        self.round_buf = torch.empty(0, dtype=torch.uint8)  # the values a finished round sends back
        self.tree = TreeRound(ps_index)  # bitwise=True rounds: the workers' subtrees
        self.embeddings = EmbeddingService(self, num_ps)
        ledger = LedgerWriter(ledger_dir, "ps0", rank=rank) if ledger_dir and ps_index == 0 else None
        self.dispatcher = Dispatcher(self, ledger=ledger) if ps_index == 0 else None  # batches handed out to the workers

    # --- lifecycle ---------------------------------------------------------------------------------
    def serve(self) -> dict[str, Any]:
        """Serve until every worker is finished or gone; return ``stats()``. Raises ``RuntimeError`` on failure."""
        threads = [threading.Thread(target=self._serve_link, args=(w,), name=f"towers-ps{self.ps_index}-w{w}",
                                    daemon=True) for w in range(len(self.links))]
        for t in threads:
            t.start()
        failed_at: float | None = None
        with self.cond:
            while len(self.finished) + len(self.dead) < len(self.links):
                if self.failure is not None:
                    failed_at = failed_at or time.monotonic()
                    if time.monotonic() - failed_at > min(self.timeout_s, 30.0):
                        break  # a hung worker must not keep a failed ps alive
                self.cond.wait(1.0)
        for t in threads:  # finished or gone workers' threads are returning; a hung one is left behind
            t.join(timeout=5.0 if self.failure is None else 0.1)
        if self.failure is not None:
            raise FailedPreconditionError(self.failure)
        if not self.finished:
            raise FailedPreconditionError(f"every worker of ps task {self.ps_index} is gone: "
                                          + "; ".join(f"{self.who(w)}: {r}" for w, r in sorted(self.dead.items())))
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Return versions and counts: ``version`` (= updates applied), per-worker versions, ``max_lead``, dead workers."""
        with self.cond:
            return {"ps_index": self.ps_index, "rank": self.rank, "mode": self.mode, "staleness": self.staleness,
                    "version": self.version, "worker_versions": list(self.worker_versions),
                    "max_lead": self.max_lead, "dead": dict(self.dead), "finished": sorted(self.finished),
                    "num_params": len(self.params), "nbytes": self.params_buf.numel(),
                    "embeddings": self.embeddings.stats(),
                    "passes": self.dispatcher.stats() if self.dispatcher is not None else {}}

    # --- the live workers (also read by the embedding service, sparse_server.py, and the dispatcher) ---------
    def who(self, w: int) -> str:
        """Name worker ``w`` for a message: its index here and its rank."""
        return f"worker {w} (rank {self.worker_ranks[w]})"

    def active(self) -> set[int]:
        """The workers that neither said goodbye nor died (caller holds the lock)."""
        return {w for w in range(len(self.links)) if w not in self.dead and w not in self.finished}

    def _serve_link(self, w: int) -> None:
        link = self.links[w]
        while True:
            try:
                msg = link.recv(timeout_s=self.timeout_s, first_timeout_s=LISTEN_TIMEOUT_S,
                                flat_out=lambda m: self.grad_bufs.get(w) if m.op == Op.PUSH else None,
                                flat_split=lambda m: self.segment_sizes)
            except LinkError as exc:
                return self._gone(w, str(exc))
            except ProtocolError as exc:
                # Nothing of the message ran (it was never unpickled); the peer is not a towers worker of
                # this job, or runs another version: tell it, then stop listening to it.
                reason = f"protocol error: {exc}"
                log.error("ps task %d: %s broke the wire protocol, dropping its link: %s", self.ps_index,
                          self.who(w), exc)
                if link.broken is None:
                    self._reply(w, Op.REPLY, status=Status.BAD_INPUT,
                                meta=f"ps task {self.ps_index} (rank {self.rank}): {reason}")
                return self._gone(w, reason)
            if msg.op == Op.BYE:
                # Reply before counting the worker as finished: serve() then closes the links, and a
                # group must not be torn down under a send still in flight.
                if self._reply(w, Op.REPLY):
                    with self.cond:
                        self.finished.add(w)
                        self.progress()
                return
            try:
                reply = self._handle(w, msg)
            except RequestError as exc:
                if not self._reply(w, Op.REPLY, status=exc.status, meta=str(exc)):
                    return
                continue
            except Exception as exc:  # noqa: BLE001 - an unexpected ps failure goes back to the worker, named
                log.exception("ps task %d failed on %s's %s", self.ps_index, self.who(w), Op.NAMES.get(msg.op))
                if not self._reply(w, Op.REPLY, status=Status.FAILED,
                                   meta=f"ps task {self.ps_index} (rank {self.rank}) failed on "
                                        f"{Op.NAMES.get(msg.op)}: {type(exc).__name__}: {exc}"):
                    return
                continue
            if w in self.shared and msg.op in (Op.REGISTER, Op.PUSH, Op.PULL) and reply.get("flat") is not None:
                self._to_shared(w, reply.pop("flat"))
            if not self._reply(w, Op.REPLY, **reply):
                return

    def _to_shared(self, w: int, flat: torch.Tensor) -> None:
        """Put a reply's parameters in worker ``w``'s shared file instead of on the wire.

        Outside the lock, like the send it replaces: in async mode it may mix in a concurrent update.
        """
        target = self.shared[w][1].tensor
        if flat.data_ptr() != target.data_ptr():  # a pull's snapshot was taken straight into it
            target.copy_(flat)

    def _reply(self, w: int, op: int, **kwargs: Any) -> bool:
        try:
            self.links[w].send(op, timeout_s=self.timeout_s, **kwargs)
            return True
        except LinkError as exc:
            self._gone(w, str(exc))
            return False

    def _gone(self, w: int, reason: str) -> None:
        with self.cond:
            if w in self.dead or w in self.finished:
                return
            self.dead[w] = reason
            log.warning("ps task %d: %s is gone (%s); %d worker(s) left", self.ps_index, self.who(w), reason,
                        len(self.active()))
            if self.dispatcher is not None:
                self.dispatcher.on_dead(w)
            if self.tree.seen and self.failure is None:  # bitwise: its micro-batches are in no one's tree
                self.failure = (f"ps task {self.ps_index}: {self.who(w)} is gone ({reason}) under bitwise=True, and "
                                "its micro-batches of the global batch cannot be summed in one device's order by "
                                "anyone else. Restart the job from its last checkpoint (towers.checkpoint."
                                "CheckpointManager: it resumes the same bits at any worker count).")
            self.progress()

    def progress(self) -> None:
        """Re-check everything that waits on the set of live workers (caller holds the lock)."""
        if self.mode == "sync" and self.arrivals and self.arrivals >= self.active() and self.failure is None:
            self._apply_round()
        self.embeddings.progress()
        self.gathers.complete()
        self.cond.notify_all()

    def wait(self, ready: Any, what: str, missing: Any) -> None:
        """Wait (lock held) until ``ready()``; raise ``RequestError`` on job failure or after ``timeout_s``.

        ``what`` names the wait and ``missing()`` the workers it waits for, in the timeout's message.
        """
        if not self.cond.wait_for(lambda: self.failure is not None or ready(), timeout=self.timeout_s):
            names = ", ".join(self.who(m) for m in sorted(missing())) or "none"
            raise RequestError(f"ps task {self.ps_index} (rank {self.rank}): {what} waited {self.timeout_s:g} s "
                               f"for {names}. A worker is hung or much slower; raise timeout_s if that is expected.")
        if self.failure is not None:
            raise RequestError(self.failure)

    # --- requests ----------------------------------------------------------------------------------
    def _handle(self, w: int, msg: Message) -> dict[str, Any]:
        if self.failure is not None:
            raise RequestError(self.failure)
        if msg.op == Op.REGISTER:
            return self._register(w, msg)
        if msg.op == Op.GATHER:
            seq, value = msg.meta
            result = self.gathers.contribute(w, seq, value, wait=self.wait)
            return {"meta": result}
        if msg.op == Op.STATS:
            return {"meta": self.stats()}
        if msg.op == Op.DISPATCH:
            if self.dispatcher is None:
                raise RequestError(f"ps task {self.ps_index} hands out no batches; ask ps task 0.", Status.BAD_INPUT)
            return {"meta": self.dispatcher.next(w, msg.meta)}
        if Op.EMB_REGISTER <= msg.op <= Op.EMB_SET:
            return self.embeddings.handle(w, msg)
        if self.layout is None:
            raise RequestError(f"ps task {self.ps_index} has no parameters yet: call strategy.prepare(model, "
                               f"optimizer) before {Op.NAMES.get(msg.op)}.", Status.BAD_INPUT)
        if msg.op == Op.PUSH:
            return self._push(w, msg)
        with self.cond:
            if msg.op == Op.PULL:
                return {"ints": (self.version,), "flat": self._snapshot(w)}
            if msg.op == Op.SET_PARAMS:
                self.params_buf.copy_(flat_values(msg))
                return {"ints": (self.version,)}
            if msg.op == Op.GET_STATE:
                state = None if self.optimizer is None else report_kernels(clone_state(self.optimizer.state_dict()))
                return {"meta": state, "ints": (self.version,)}
            if msg.op == Op.SET_STATE:
                if self.optimizer is not None:
                    try:
                        self.optimizer.load_state_dict(msg.meta)
                        if not self.exact_kernels:  # a loaded state sets the groups' kernel choices again
                            use_fast_kernels(self.optimizer)
                    except (ValueError, KeyError, TypeError) as exc:
                        raise RequestError(f"ps task {self.ps_index} could not load the optimizer state: {exc}. "
                                           "Load a state saved from the same model and optimizer.",
                                           Status.BAD_INPUT) from exc
                return {"ints": (self.version,)}
        raise RequestError(f"ps task {self.ps_index} got an unknown request op={msg.op}.")
