"""Row-sharded embedding tables: the ids hashing and row initialisation both sides share, and a ps task's shard.

Row ``r`` of a table lives on ps task ``r % num_ps`` at local row ``r // num_ps``. A shard's
storage is allocated once with ``torch.empty`` and written only where a row is first touched
(initialised then, with its optimizer slots), so the memory a ps task really uses grows with the
rows the job touches, not with the table's declared size.

Row-wise ("lazy") optimizers update only the rows a step touched:

* ``sgd``: ``w -= lr * g`` — the same as ``torch.optim.SGD`` (no momentum, no weight decay) on
  the whole table, since an untouched row's gradient is zero.
* ``adagrad``: ``s += g*g; w -= lr * g / (sqrt(s) + eps)`` — the same as ``torch.optim.Adagrad``
  with ``lr_decay=0`` and ``weight_decay=0`` (an untouched row adds zero to ``s`` and moves by zero).
* ``adam``: torch's Adam formula, but each row counts its own steps (bias correction per row) and
  an untouched row keeps its moments; a dense ``torch.optim.Adam`` also moves untouched rows
  through their momentum. The two agree only while every step touches every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from towers.errors import InvalidArgumentError

__all__ = ["TableSpec", "TableShard", "ROW_OPTIMIZERS", "hash_ids", "initial_rows"]

#: Row-wise optimizers and the options each takes (with defaults).
ROW_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.01},
    "adagrad": {"lr": 0.01, "eps": 1e-10, "initial_accumulator_value": 0.0},
    "adam": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8},
}
_SLOTS = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq", "step")}
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 arithmetic that never overflows: every product stays below 2**60)."""
    x = x & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return ((x >> 16) ^ x) & _M32


def hash_ids(ids: torch.Tensor, num_embeddings: int, *, salt: int = 0) -> torch.Tensor:
    """Return ``ids`` (any int64 values) hashed into ``[0, num_embeddings)``; distinct ids may collide."""
    ids = ids.to(torch.int64)
    low, high = ids & _M32, (ids >> 32) & _M32
    h = _mix32(_mix32(low ^ (salt * 0x9E3779B1 & _M32)) ^ high)
    h = (h << 31) ^ _mix32(h + 0x632BE5AB)  # 63 bits, so large tables use all their rows
    return torch.remainder(h, num_embeddings)


def initial_rows(ids: torch.Tensor, dim: int, *, seed: int, scale: float,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return the first-touch values of rows ``ids``: uniform in ``[-scale, scale]``, a function of (seed, id, column).

    Every process computes the same rows, so where a row lives (or whether it lives in a plain
    ``nn.EmbeddingBag`` built with ``initial_rows(torch.arange(n), ...)``) does not change its start value.
    """
    ids = ids.to(torch.int64).reshape(-1, 1)
    cols = torch.arange(dim, dtype=torch.int64).reshape(1, -1)
    x = _mix32(_mix32(ids ^ (seed * 0x27D4EB2D & _M32)) ^ _mix32((ids >> 32) + cols * 0x165667B1))
    u = x.to(torch.float64) / float(_M32 + 1)
    return ((u * 2.0 - 1.0) * scale).to(dtype)


@dataclass(frozen=True)
class TableSpec:
    """One table as every worker declares it: what must match across workers, sent as JSON."""

    name: str
    num_embeddings: int
    dim: int
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    scale: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """Return the spec as JSON values."""
        return {"name": self.name, "num_embeddings": self.num_embeddings, "dim": self.dim,
                "optimizer": self.optimizer, "options": dict(self.options), "seed": self.seed, "scale": self.scale}

    @classmethod
    def from_json(cls, value: Any) -> "TableSpec":
        """Return the spec a peer sent. Raises ``ValueError`` when it is malformed."""
        if not isinstance(value, dict):
            raise InvalidArgumentError(f"a table spec must be a JSON object. Received: {type(value).__name__}.")
        try:
            spec = cls(str(value["name"]), int(value["num_embeddings"]), int(value["dim"]), str(value["optimizer"]),
                       dict(value["options"]), int(value["seed"]), float(value["scale"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"malformed table spec {value!r}: {exc}") from None
        if spec.num_embeddings < 1 or spec.dim < 1 or spec.optimizer not in ROW_OPTIMIZERS:
            raise InvalidArgumentError(f"bad table spec {value!r}: sizes must be >= 1 and the optimizer one of "
                                       f"{', '.join(ROW_OPTIMIZERS)}.")
        return spec


class TableShard:
    """The rows of one table that one ps task holds, their optimizer slots, and row-wise updates."""

    def __init__(self, spec: TableSpec, *, ps_index: int, num_ps: int):
        self.spec, self.ps_index, self.num_ps = spec, ps_index, num_ps
        self.local_rows = max(0, -(-(spec.num_embeddings - ps_index) // num_ps))
        self.options = {**ROW_OPTIMIZERS[spec.optimizer], **spec.options}
        # torch.empty of a large size maps pages lazily: only touched rows cost memory.
        self.weight = torch.empty(self.local_rows, spec.dim)
        self.touched = torch.zeros(self.local_rows, dtype=torch.bool)
        self.slots = {name: torch.empty(self.local_rows, *(() if name == "step" else (spec.dim,)))
                      for name in _SLOTS[spec.optimizer]}

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (bool((ids % self.num_ps != self.ps_index).any()) or int(ids.min()) < 0
                            or int(ids.max()) >= self.spec.num_embeddings):
            raise InvalidArgumentError(f"table {self.spec.name!r}: ids outside ps task {self.ps_index}'s rows "
                                       f"(row % {self.num_ps} == {self.ps_index}, below {self.spec.num_embeddings}).")
        return torch.div(ids, self.num_ps, rounding_mode="floor")

    def _touch(self, ids: torch.Tensor, local: torch.Tensor) -> None:
        new = ~self.touched[local]
        if not bool(new.any()):
            return
        fresh_ids, fresh = ids[new], local[new]
        self.weight[fresh] = initial_rows(fresh_ids, self.spec.dim, seed=self.spec.seed, scale=self.spec.scale)
        for name, slot in self.slots.items():
            slot[fresh] = self.options.get("initial_accumulator_value", 0.0) if name == "sum" else 0.0
        self.touched[fresh] = True

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the rows ``ids`` (global ids of this shard), initialising rows touched for the first time."""
        local = self._local(ids)
        self._touch(ids, local)
        return self.weight[local]

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply one optimizer step to the rows ``ids`` with gradients ``grads`` (duplicate ids are summed)."""
        if not ids.numel():
            return
        if grads.shape != (ids.numel(), self.spec.dim):
            raise InvalidArgumentError(f"table {self.spec.name!r}: {ids.numel()} ids need gradients of shape "
                                       f"{[ids.numel(), self.spec.dim]}. Received: {list(grads.shape)}.")
        unique, inverse = torch.unique(ids, return_inverse=True)
        g = torch.zeros(unique.numel(), self.spec.dim, dtype=self.weight.dtype)
        g.index_add_(0, inverse, grads.to(self.weight.dtype))
        local = self._local(unique)
        self._touch(unique, local)
        w, o = self.weight[local], self.options
        if self.spec.optimizer == "sgd":
            w.add_(g, alpha=-o["lr"])
        elif self.spec.optimizer == "adagrad":
            s = self.slots["sum"][local].addcmul_(g, g, value=1.0)
            self.slots["sum"][local] = s
            w.addcdiv_(g, s.sqrt().add_(o["eps"]), value=-o["lr"])
        else:
            beta1, beta2 = o["betas"]
            step = self.slots["step"][local] + 1
            m = self.slots["exp_avg"][local].lerp_(g, 1 - beta1)
            v = self.slots["exp_avg_sq"][local].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bc1 = 1 - beta1 ** step
            bc2_sqrt = (1 - beta2 ** step).sqrt()
            denom = (v.sqrt() / bc2_sqrt.unsqueeze(1)).add_(o["eps"])
            w.addcdiv_(m, denom * (bc1 / o["lr"]).unsqueeze(1), value=-1.0)
            self.slots["step"][local], self.slots["exp_avg"][local], self.slots["exp_avg_sq"][local] = step, m, v
        self.weight[local] = w

    def export(self) -> dict[str, torch.Tensor]:
        """Return the touched rows: ``ids`` (global), ``weight`` and one tensor per optimizer slot."""
        local = self.touched.nonzero().reshape(-1)
        out = {"ids": local * self.num_ps + self.ps_index, "weight": self.weight[local].clone()}
        out.update({f"slot_{name}": slot[local].clone() for name, slot in self.slots.items()})
        return out

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Replace this shard's rows with ``state`` (from ``export``); rows it does not name become untouched.

        Raises:
            ValueError: missing or mis-shaped entries.
        """
        keys = {"ids", "weight", *(f"slot_{n}" for n in self.slots)}
        if not isinstance(state, dict) or not keys <= set(state):
            raise InvalidArgumentError(f"table {self.spec.name!r}: a saved shard needs {sorted(keys)}. Received: "
                                       f"{sorted(state) if isinstance(state, dict) else type(state).__name__}.")
        ids = state["ids"].to(torch.int64).reshape(-1)
        local = self._local(ids)
        if state["weight"].shape != (ids.numel(), self.spec.dim):
            raise InvalidArgumentError(f"table {self.spec.name!r}: saved weight has shape {list(state['weight'].shape)}, "
                                       f"expected {[ids.numel(), self.spec.dim]}.")
        self.touched.zero_()
        self.weight[local] = state["weight"].to(self.weight.dtype)
        for name, slot in self.slots.items():
            slot[local] = state[f"slot_{name}"].to(slot.dtype)
        self.touched[local] = True

    def stats(self) -> dict[str, Any]:
        """Return the table's name, its local rows and how many have been touched."""
        return {"name": self.spec.name, "local_rows": self.local_rows, "touched": int(self.touched.sum())}


def check_options(optimizer: str, options: dict[str, Any]) -> dict[str, Any]:
    """Return ``options`` checked against ``optimizer``'s (JSON numbers and lists only).

    Raises:
        ValueError: unknown optimizer, unknown option, or a value that is not a number.
    """
    if optimizer not in ROW_OPTIMIZERS:
        raise InvalidArgumentError(f"optimizer must be one of {', '.join(ROW_OPTIMIZERS)} (row-wise, run on the ps tasks). "
                                   f"Received: {optimizer!r}.")
    known = ROW_OPTIMIZERS[optimizer]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InvalidArgumentError(f"{optimizer} takes the options {sorted(known)}. Received unknown options {unknown}.")
    out = {}
    for key, value in {**known, **options}.items():
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise InvalidArgumentError(f"{optimizer} option {key} must be a finite number (or a list of them). Received: "
                                       f"{value!r}.")
        out[key] = [float(v) for v in values] if isinstance(value, (list, tuple)) else float(value)
    lr = out["lr"]
    if not isinstance(lr, float) or lr <= 0:
        raise InvalidArgumentError(f"lr must be a number > 0. Received: lr={lr}.")
    return out
