"""``ShardedEmbedding``: an ``nn.EmbeddingBag``-like table whose rows live on the ps tasks.

A forward deduplicates its ids, pulls only those rows (one request per ps task that owns some,
in parallel), and pools them on the worker; the rows become a leaf tensor, so the backward
leaves their gradients there. The prepared optimizer's ``step()`` pushes every touched row's
gradient to its ps task, where a row-wise optimizer (``tables.py``) updates the rows, with the
strategy's ``sync``/``async``/``staleness`` rules. ``model.state_dict()`` fetches the touched
rows and their optimizer slots from the ps tasks into one entry, ``<name>.rows`` (a dict:
``ids``, ``weight``, ``slot_*``), and ``load_state_dict`` sends them back, so checkpoints
(``BackupAndRestore``) hold the tables too.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from towers.errors import FailedPreconditionError, InvalidArgumentError, user_error
from towers.strategies._copies import refuse_copies
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.tables import ROW_OPTIMIZERS, TableSpec, check_options, hash_ids, initial_rows
from towers.strategies.parameter_server.transport import Op

__all__ = ["ShardedEmbedding", "SparseTables", "bind_tables", "MODES"]

#: What works instead of a copy of a model whose tables' rows live on the ps tasks.
ROWS_ON_PS_FIX = ("Use strategy.full_state_dict(model) for its weights (the dense parameters, and under '<table>.rows' the "
                  "rows the tables touched, fetched from the ps tasks) and strategy.save_checkpoint(...) for checkpoints. "
                  "towers.ExponentialMovingAverage(model, decay=..., strategy=strategy) averages the dense parameters; "
                  "the rows stay on the ps tasks, not averaged.")

#: Pooling modes: ``sum``/``mean`` over each bag (``nn.EmbeddingBag``), or ``none`` (one row per id, ``nn.Embedding``).
MODES = ("sum", "mean", "none")
_INT32_MAX = 2**31 - 1


class ShardedEmbedding(nn.Module):
    """An embedding table split by row over the ps tasks; a step pulls and pushes only the rows it touches.

    Args:
        num_embeddings: rows of the table (with ``hashed=True``: the size ids are hashed into).
        embedding_dim: columns.
        mode: ``"sum"`` or ``"mean"`` pooling of each bag (like ``nn.EmbeddingBag``), or ``"none"``:
            one row per id, output shape ``input.shape + (embedding_dim,)`` (like ``nn.Embedding``).
        hashed: ids are any int64 values, hashed into ``[0, num_embeddings)``; distinct ids can then
            share a row (a collision: the expected number of colliding pairs among ``k`` distinct
            ids is about ``k*(k-1)/(2*num_embeddings)``). Without it ids must lie in ``[0, num_embeddings)``.
        optimizer: row-wise optimizer run on the ps tasks: ``"sgd"``, ``"adagrad"`` or ``"adam"``.
        lr: its learning rate (default: the optimizer's, see ``tables.ROW_OPTIMIZERS``).
        optimizer_options: its other options (``eps``, ``betas``, ``initial_accumulator_value``).
        init_scale: rows start uniform in ``[-init_scale, init_scale]`` (default ``1/sqrt(embedding_dim)``),
            initialised on first touch from ``(seed, row)``: see ``initial_weight``.
        seed: seeds the rows' initial values.

    Raises:
        ValueError: a bad size, mode, optimizer or option.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "sum", hashed: bool = False,
                 optimizer: str = "adagrad", lr: float | None = None,
                 optimizer_options: Mapping[str, Any] | None = None, init_scale: float | None = None, seed: int = 0):
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1. Received: {name}={value!r}.")
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}. Received: mode={mode!r}.")
        options = dict(optimizer_options or {})
        if lr is not None:
            options["lr"] = lr
        self.num_embeddings, self.embedding_dim, self.mode, self.hashed = num_embeddings, embedding_dim, mode, hashed
        self.seed = int(seed)
        self.init_scale = float(init_scale if init_scale is not None else embedding_dim ** -0.5)
        self.optimizer = optimizer
        self.optimizer_options = check_options(optimizer, options)
        self._tables: SparseTables | None = None
        self._index = -1

    def connect(self, tables: "SparseTables", index: int) -> None:
        """Keep this table's rows in ``tables`` (as its table ``index``): ``strategy.prepare`` connects it.

        From then on the rows live on the ps tasks only: a copy of the model (``copy.deepcopy``, pickle,
        ``AveragedModel``) is refused with what works instead.
        """
        self._tables, self._index = tables, index
        refuse_copies(self, f"the rows of its {type(self).__name__}({self.num_embeddings}, {self.embedding_dim}) live "
                            "on the parameter servers' ps tasks", ROWS_ON_PS_FIX)

    def spec(self, name: str) -> TableSpec:
        """Return what the ps tasks are told about this table (``name``: its place in the model)."""
        return TableSpec(name, self.num_embeddings, self.embedding_dim, self.optimizer, dict(self.optimizer_options),
                         self.seed, self.init_scale)

    def initial_weight(self, rows: int | None = None) -> torch.Tensor:
        """Return the first-touch values of rows ``0 .. rows-1`` (default all), to build an equal plain table."""
        n = self.num_embeddings if rows is None else rows
        return initial_rows(torch.arange(n), self.embedding_dim, seed=self.seed, scale=self.init_scale)

    @staticmethod
    def hash(ids: torch.Tensor, num_embeddings: int, seed: int = 0) -> torch.Tensor:
        """Return the rows ``hashed=True`` maps ``ids`` to (to build an equal plain table for one process)."""
        return hash_ids(ids, num_embeddings, salt=seed)

    def row_ids(self, input: torch.Tensor) -> torch.Tensor:
        """Return the table rows of ``input``'s ids (hashed when ``hashed=True``).

        Raises:
            ValueError: without hashing, an id outside ``[0, num_embeddings)``.
        """
        ids = input.to(torch.int64)
        if self.hashed:
            return hash_ids(ids, self.num_embeddings, salt=self.seed)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise InvalidArgumentError(f"ShardedEmbedding ids must lie in [0, {self.num_embeddings}). Received ids from "
                                       f"{int(ids.min())} to {int(ids.max())}. Use hashed=True for ids of no fixed range.")
        return ids

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Return the pooled rows of each bag (``mode`` sum/mean) or one row per id (``mode="none"``).

        ``input``: a 2-D tensor of fixed-length bags, or 1-D ids with ``offsets`` (bag starts), as
        ``nn.EmbeddingBag`` takes them.

        Raises:
            RuntimeError: the model was not prepared by a strategy with parameter servers.
        """
        if self._tables is None:
            raise FailedPreconditionError(
                "ShardedEmbedding keeps its rows on the ps tasks, and this one is not connected to any: prepare the "
                "model first (`model, optimizer = strategy.prepare(model, optimizer)` with ParameterServerStrategy "
                "or HybridStrategy). For one process, use nn.EmbeddingBag(..., _weight=table.initial_weight()).")
        rows_of = self.row_ids(input)
        unique, inverse = torch.unique(rows_of.reshape(-1).cpu(), return_inverse=True)
        rows = self._tables.lookup(self._index, unique).to(input.device)
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._tables.record(self._index, unique, rows)
        inverse = inverse.to(input.device).reshape(rows_of.shape)
        if self.mode == "none":
            return F.embedding(inverse, rows)
        if input.dim() == 2 and offsets is not None:
            raise InvalidArgumentError("offsets go with 1-D input only (as in nn.EmbeddingBag). Received a 2-D input and "
                                       "offsets.")
        if input.dim() == 1 and offsets is None:
            raise InvalidArgumentError("1-D input needs offsets (the start of each bag), as in nn.EmbeddingBag. Received none.")
        return F.embedding_bag(inverse, rows, offsets, mode=self.mode)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # One entry, a dict: the number of touched rows changes as training goes, so the table cannot be a
        # tensor of a fixed shape (checkpoint loaders compare tensor shapes with the model's).
        if self._tables is not None:
            destination[prefix + "rows"] = self._tables.export(self._index)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "rows"
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k != key
                                   and "." not in k[len(prefix):])
        if self._tables is None:
            if key in state_dict:
                error_msgs.append("ShardedEmbedding: cannot load rows before the model is prepared (its rows live on "
                                  "the ps tasks). Load after strategy.prepare().")
            return
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        rows = state_dict[key]
        if not isinstance(rows, Mapping):
            error_msgs.append(f"{key} must be a dict of tensors (ids, weight, slot_*). Received: {type(rows).__name__}.")
            return
        try:
            self._tables.load(self._index, dict(rows))
        except ValueError as exc:
            error_msgs.append(str(exc))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, hashed={self.hashed}, "
                f"optimizer={self.optimizer!r}, lr={self.optimizer_options['lr']:g}")


class SparseTables:
    """A worker's connection of its model's ``ShardedEmbedding`` tables to the ps tasks."""

    def __init__(self, model: nn.Module, client: ParameterClient, *, num_ps: int, generation: int = 0):
        self.client, self.num_ps = client, num_ps
        self.generation = generation  # which of the job's models (a later one gets new tables on the ps tasks)
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, ShardedEmbedding)]
        self.modules = [m for _, m in named]
        self.specs = [m.spec(name or "table") for name, m in named]
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.version = 0
        #: rows pulled and pushed, and their bytes of values (the touched-rows ideal of the wire)
        self.rows_pulled = self.rows_pushed = 0
        self.row_bytes = 0

    def __len__(self) -> int:
        return len(self.modules)

    def refuse_weighted_loss(self) -> None:
        """Raise: ``compute_average_loss(..., weights=...)`` cannot normalise the rows' gradients (pushed apart)."""
        raise user_error(
            "compute_average_loss(..., weights=...) cannot normalise the gradients of ShardedEmbedding rows (they "
            "go to the ps tasks apart from the dense gradients)", f"a model with {len(self)} table(s)",
            "Normalise by examples instead: compute_average_loss(per_example_loss) with one loss per example "
            "(e.g. each example's mean over its tokens).")

    def register(self) -> None:
        """Tell every ps task about the tables (the first worker's specs create them) and bind the modules.

        Raises:
            ValueError: this worker's tables differ from those the ps tasks hold.
        """
        self.client.request(Op.EMB_REGISTER, metas=[{"tables": [s.to_json() for s in self.specs],
                                                     "generation": self.generation}] * self.num_ps)
        for i, module in enumerate(self.modules):
            module.connect(self, i)

    def _wire_ids(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        return ids.to(torch.int32) if self.specs[t].num_embeddings <= _INT32_MAX else ids

    def lookup(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        """Return the rows ``ids`` (unique, CPU int64) of table ``t``, pulled from the ps tasks that own them."""
        owner = ids % self.num_ps
        targets = [p for p in range(self.num_ps) if bool((owner == p).any())] if self.num_ps > 1 else [0]
        picks = [(owner == p).nonzero().reshape(-1) for p in targets] if self.num_ps > 1 else [None]
        metas = [{"t": t, "ids": self._wire_ids(t, ids if pick is None else ids[pick])} for pick in picks]
        if not ids.numel():
            return torch.empty(0, self.specs[t].dim)
        replies = self.client.request(Op.EMB_PULL, ps=targets, metas=metas)
        self.rows_pulled += ids.numel()
        self.row_bytes += ids.numel() * self.specs[t].dim * 4
        if self.num_ps == 1:
            return replies[0].meta["rows"]
        rows = torch.empty(ids.numel(), self.specs[t].dim)
        for pick, reply in zip(picks, replies):
            rows[pick] = reply.meta["rows"]
        return rows

    def record(self, t: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Remember a lookup whose rows' gradients the next ``push`` sends."""
        self.pending.append((t, ids, rows))

    def zero_grad(self) -> None:
        """Drop the gradients of recorded lookups (as ``optimizer.zero_grad()`` does for parameters)."""
        for _, _, rows in self.pending:
            rows.grad = None

    def push(self) -> None:
        """Send every recorded row gradient to its ps task (every ps task gets a message: sync rounds count them)."""
        per_ps: list[list[list[Any]]] = [[] for _ in range(self.num_ps)]
        for t in range(len(self.specs)):
            entries = [(ids, rows.grad) for tt, ids, rows in self.pending if tt == t and rows.grad is not None]
            if not entries:
                continue
            ids = torch.cat([e[0] for e in entries])
            grads = torch.cat([e[1].detach().to("cpu", torch.float32) for e in entries])
            if len(entries) > 1:  # the same row looked up twice in one step: one gradient on the wire
                ids, inverse = torch.unique(ids, return_inverse=True)
                grads = torch.zeros(ids.numel(), grads.shape[1]).index_add_(0, inverse, grads)
            self.rows_pushed += ids.numel()
            self.row_bytes += ids.numel() * self.specs[t].dim * 4
            if self.num_ps == 1:
                per_ps[0].append([t, self._wire_ids(t, ids), grads])
                continue
            owner = ids % self.num_ps
            for p in range(self.num_ps):
                pick = owner == p
                if bool(pick.any()):
                    per_ps[p].append([t, self._wire_ids(t, ids[pick]), grads[pick]])
        self.pending.clear()
        replies = self.client.request(Op.EMB_PUSH, metas=[{"tables": entries} for entries in per_ps])
        self.version = max(r.ints[0] for r in replies)

    def export(self, t: int) -> dict[str, torch.Tensor]:
        """Return table ``t``'s touched rows from every ps task: ``ids``, ``weight``, ``slot_*`` (ids ascending)."""
        parts = [r.meta for r in self.client.request(Op.EMB_GET, metas=[{"t": t}] * self.num_ps)]
        merged = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
        order = torch.argsort(merged["ids"])
        return {k: v[order].clone() for k, v in merged.items()}

    def load(self, t: int, state: Mapping[str, torch.Tensor]) -> None:
        """Send rows saved by ``export`` back to their ps tasks.

        Raises:
            ValueError: the state lacks ``ids`` or a ps task refuses it.
        """
        if "ids" not in state:
            raise InvalidArgumentError(f"table {self.specs[t].name!r}: a saved table needs 'ids'. Received keys {sorted(state)}.")
        ids = state["ids"].to(torch.int64)
        owner = ids % self.num_ps
        metas = [{"t": t, "state": {k: v[owner == p] for k, v in state.items()}} for p in range(self.num_ps)]
        self.client.request(Op.EMB_SET, metas=metas)


def bind_tables(model: nn.Module, optimizer: torch.optim.Optimizer | None, client: ParameterClient, *, num_ps: int,
                generation: int) -> SparseTables | None:
    """Connect ``model``'s ``ShardedEmbedding`` tables to the ps tasks (registered there); None when it has none.

    Raises:
        ValueError: the model has tables and no ``optimizer`` (its ``step()`` sends the rows' gradients).
    """
    sparse = SparseTables(model, client, num_ps=num_ps, generation=generation)
    if not len(sparse):
        return None
    if optimizer is None:
        raise InvalidArgumentError(
            f"The model has {len(sparse)} ShardedEmbedding table(s) and no optimizer was passed to prepare(). "
            "Expected `strategy.prepare(model, optimizer)`: the prepared optimizer's step() sends the rows' "
            "gradients to the ps tasks (their own row-wise optimizer is set on each ShardedEmbedding).")
    sparse.register()
    return sparse


def row_optimizer_names() -> list[str]:
    """Return the row-wise optimizers a ``ShardedEmbedding`` can use."""
    return list(ROW_OPTIMIZERS)
