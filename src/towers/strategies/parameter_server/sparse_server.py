"""A ps task's embedding rows: table registration, row pulls, row-gradient pushes (sync rounds or async), state.

Shares the server's lock, live-worker set and bounded waits (``server.py``). Embedding pushes
have their own rounds and versions: a step's dense push and its embedding push are two
messages, and each is complete on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.tables import TableShard, TableSpec
from towers.strategies.parameter_server.transport import Message, Op, Status

if TYPE_CHECKING:
    from towers.strategies.parameter_server.server import ParameterServer

__all__ = ["EmbeddingService"]


class EmbeddingService:
    """The embedding tables of one ps task and the requests that reach them."""

    def __init__(self, server: "ParameterServer", num_ps: int):
        self.server, self.num_ps = server, num_ps
        self.tables: list[TableShard] | None = None
        self.specs: list[TableSpec] = []
        self.generation = 0  # which of the job's models the tables belong to
        self.version = 0
        self.max_lead = 0
        self.worker_versions = [0] * len(server.links)
        self.round = 0
        self.arrivals: set[int] = set()
        self.pending: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def stats(self) -> dict[str, Any]:
        """Return the embedding version and each table's rows here (caller holds the lock)."""
        return {"version": self.version, "worker_versions": list(self.worker_versions), "max_lead": self.max_lead,
                "tables": [t.stats() for t in self.tables or []]}

    def progress(self) -> None:
        """Finish a sync round no live worker still owes a push to (caller holds the lock)."""
        if self.server.mode == "sync" and self.arrivals and self.arrivals >= self.server.active():
            self._apply_round()

    def handle(self, w: int, msg: Message) -> dict[str, Any]:
        """Serve one embedding request of worker ``w``; return the reply's parts."""
        meta = msg.meta if isinstance(msg.meta, dict) else {}
        if msg.op == Op.EMB_REGISTER:
            return self._register(w, meta)
        if self.tables is None:
            raise RequestError(f"ps task {self.server.ps_index} holds no embedding table yet: prepare the model "
                               f"(strategy.prepare) before {Op.NAMES.get(msg.op)}.", Status.BAD_INPUT)
        if msg.op == Op.EMB_PUSH:
            return self._push(w, meta)
        table = self._table(meta.get("t"))
        with self.server.cond:
            try:
                if msg.op == Op.EMB_PULL:
                    return {"meta": {"rows": table.lookup(self._ids(meta.get("ids")))}, "ints": (self.version,)}
                if msg.op == Op.EMB_GET:
                    return {"meta": table.export(), "ints": (self.version,)}
                if msg.op == Op.EMB_SET:
                    state = meta.get("state")
                    table.load(state if isinstance(state, dict) else {})
                    return {"ints": (self.version,)}
            except ValueError as exc:
                raise RequestError(f"ps task {self.server.ps_index}: {exc}", Status.BAD_INPUT) from exc
        raise RequestError(f"ps task {self.server.ps_index} got an unknown request op={msg.op}.")

    def _table(self, t: Any) -> TableShard:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < len(self.tables or []):
            raise RequestError(f"ps task {self.server.ps_index}: no embedding table #{t!r} (it holds "
                               f"{len(self.tables or [])}).", Status.BAD_INPUT)
        return self.tables[t]  # type: ignore[index]

    def _ids(self, ids: Any) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise RequestError(f"ps task {self.server.ps_index}: ids must be a 1-D int32/int64 tensor.", Status.BAD_INPUT)
        return ids.to(torch.int64)

    def _register(self, w: int, meta: dict[str, Any]) -> dict[str, Any]:
        try:
            specs = [TableSpec.from_json(s) for s in meta.get("tables", [])]
        except ValueError as exc:
            raise RequestError(f"ps task {self.server.ps_index}: {exc}", Status.BAD_INPUT) from exc
        generation = int(meta.get("generation", 0))
        with self.server.cond:
            self.server.turnover.arrive(w, generation, self.generation, "the embedding tables")
            if self.tables is not None and generation > self.generation:
                # Another model of the same job: new tables (fresh rows, as a new model's) once no live worker can
                # still push rows of the earlier one.
                self.server.turnover.wait_for_all(generation, "the embedding tables")
                if generation > self.generation:  # the first worker to get here replaces them
                    self.tables, self.generation = None, generation
            if self.tables is None:
                self.specs = specs
                self.tables = [TableShard(s, ps_index=self.server.ps_index, num_ps=self.num_ps) for s in specs]
            elif specs != self.specs:
                raise RequestError(
                    f"{self.server.who(w)}'s embedding tables differ from those ps task {self.server.ps_index} "
                    f"holds: expected {[s.to_json() for s in self.specs]}, received {[s.to_json() for s in specs]}. "
                    "Build the same ShardedEmbedding modules on every worker.", Status.BAD_INPUT)
            return {"ints": (self.version,)}

    def _entries(self, meta: dict[str, Any]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        out = []
        for entry in meta.get("tables", []):
            if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[2], torch.Tensor):
                raise RequestError(f"ps task {self.server.ps_index}: a push entry is [table, ids, grads].",
                                   Status.BAD_INPUT)
            t, ids, grads = entry
            table = self._table(t)
            ids = self._ids(ids)
            if grads.shape != (ids.numel(), table.spec.dim) or not grads.is_floating_point():
                raise RequestError(f"ps task {self.server.ps_index}: table {table.spec.name!r} got {ids.numel()} ids "
                                   f"and gradients of shape {list(grads.shape)}.", Status.BAD_INPUT)
            out.append((t, ids, grads))
        return out

    def _push(self, w: int, meta: dict[str, Any]) -> dict[str, Any]:
        entries = self._entries(meta)
        server = self.server
        with server.cond:
            if server.mode == "async":
                if server.staleness is not None:
                    server.wait(lambda: self._lead(w) <= server.staleness,
                                f"embedding push (staleness {server.staleness})",
                                lambda: [u for u in server.active() - {w}
                                         if self.worker_versions[w] - self.worker_versions[u] > server.staleness])
                self.max_lead = max(self.max_lead, self._lead(w))
                self._apply(entries)
                self.version += 1
                self.worker_versions[w] += 1
                server.cond.notify_all()
                return {"ints": (self.version, self.worker_versions[w], len(server.dead))}
            my_round = self.round
            self.pending[w] = entries
            self.arrivals.add(w)
            server.progress()
            server.wait(lambda: self.round != my_round, f"embedding sync round {my_round}",
                        lambda: server.active() - self.arrivals)
            return {"ints": (self.version, self.worker_versions[w], len(server.dead))}

    def _lead(self, w: int) -> int:
        others = [self.worker_versions[u] for u in self.server.active() if u != w]
        return self.worker_versions[w] - min(others) if others else 0

    def _apply(self, entries: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        by_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for t, ids, grads in entries:
            by_table.setdefault(t, []).append((ids, grads))
        for t, parts in by_table.items():
            try:
                self.tables[t].apply(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))  # type: ignore[index]
            except ValueError as exc:
                raise RequestError(f"ps task {self.server.ps_index}: {exc}", Status.BAD_INPUT) from exc

    def _apply_round(self) -> None:
        workers = sorted(self.arrivals)
        self._apply([e for u in workers for e in self.pending.get(u, [])])
        self.pending.clear()
        self.arrivals.clear()
        self.round += 1
        self.version += 1
        for u in workers:
            self.worker_versions[u] += 1
        self.server.cond.notify_all()
