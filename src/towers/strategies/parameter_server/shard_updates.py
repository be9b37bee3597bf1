"""A ps task's shard and the updates applied to it: the chief's registration (the shard's values and optimizer), a
worker's registration (its buffers, or its shared memory), pushes applied on arrival (``async``) or summed into one
round (``sync``), and the optimizer steps. A push with a ``weight`` (DiLoCo's parameter change) is averaged by the
weights in its round, or scaled by it on arrival (``async``); a ``packed`` one carries compressed values
(``diloco_codec``). Part of ``ParameterServer`` (``server.py``), under its one lock."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from towers._logging import get_logger
from towers.strategies.parameter_server.diloco_codec import unpack_delta
from towers.strategies.parameter_server.dispatch import Dispatcher, unpack_unit
from towers.strategies.parameter_server.generations import ModelTurnover
from towers.strategies.parameter_server.requests import KERNEL_KEYS, RequestError, build_optimizer
from towers.strategies.parameter_server.sharding import SEGMENT_MIN_BYTES, FlatLayout, ParamSpec, signature_mismatch
from towers.strategies.parameter_server.shared import SharedBuffer, attach
from towers.strategies.parameter_server.transport import Message, Op, Status
from towers.strategies.parameter_server.tree_round import TreeRound

__all__ = ["ShardUpdates", "flat_values"]

log = get_logger("towers.strategies.parameter_server.server")  # the records keep the name they had in server.py


class ShardUpdates:
    """Registration, pushes and steps of a ``ParameterServer``; the state is set up by its ``__init__``."""

    ps_index: int
    mode: str
    staleness: int | None
    shared_memory: bool
    cond: threading.Condition
    failure: str | None
    dead: dict[int, str]
    worker_versions: list[int]
    version: int
    max_lead: int
    signature: list[ParamSpec] | None
    layout: FlatLayout | None
    segment_sizes: list[int]
    params_buf: torch.Tensor
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    exact_kernels: bool = False  # bitwise=True: the optimizer keeps torch's kernel choice (one device's bits)
    grad_bufs: dict[int, torch.Tensor]
    reply_bufs: dict[int, torch.Tensor]
    shared: dict[int, tuple[SharedBuffer, SharedBuffer]]
    round: int
    arrivals: set[int]
    present: list[bool]
    sum_buf: torch.Tensor
    round_buf: torch.Tensor
    #: A sync round of weighted pushes (DiLoCo's parameter changes): the sum of the weights; None: plain sums.
    round_weight: float | None = None
    dispatcher: Dispatcher | None
    tree: TreeRound  # a bitwise round's subtrees (``tree_round.py``)
    generation: int  # which of the job's models the shard holds (a later strategy.prepare replaces it)
    turnover: ModelTurnover  # the latest model each worker registered (shared with the embedding tables)
    # the serving side's (server.py)
    who: Callable[[int], str]
    active: Callable[[], set[int]]
    progress: Callable[[], None]
    wait: Callable[..., None]

    def _register(self, w: int, msg: Message) -> dict[str, Any]:
        meta = msg.meta
        if not isinstance(meta, dict) or not {"chief", "signature", "shard", "optimizer"} <= set(meta):
            raise RequestError(f"ps task {self.ps_index}: a register request needs chief, signature, shard and "
                               "optimizer.", Status.BAD_INPUT)
        try:
            meta["signature"] = [ParamSpec(str(n), tuple(int(d) for d in shape), str(dt))
                                 for n, shape, dt in meta["signature"]]
        except (TypeError, ValueError) as exc:
            raise RequestError(f"ps task {self.ps_index}: malformed model signature ({exc}).", Status.BAD_INPUT) from exc
        generation = int(meta.get("generation", 0))
        with self.cond:
            self.turnover.arrive(w, generation, self.generation, "the parameters")
            if meta["chief"] and (self.signature is None or generation > self.generation):
                if self.signature is not None:
                    # Another model of the same job (a second prepare): it replaces the first once no live worker
                    # can still push for the first, and starts from the chief's values with a new optimizer.
                    self.turnover.wait_for_all(generation, "the registration")
                    self.grad_bufs.clear()
                    self.reply_bufs.clear()
                self._initialise(meta, msg.flat)
                self.generation = generation
                self.cond.notify_all()
            self.wait(lambda: self.signature is not None and self.generation >= generation, "registration",
                      lambda: [0] if self.signature is None or self.generation < generation else [])
            diff = signature_mismatch(self.signature or [], meta["signature"])
            if diff is not None:
                raise RequestError(
                    f"{self.who(w)}'s model does not match the model the chief registered on ps task "
                    f"{self.ps_index}: {diff}. Build the same model (same parameter names, shapes and dtypes) on "
                    "every worker before strategy.prepare().", Status.BAD_INPUT)
            shared = self._attach(w, meta.get("shared"))
            if not shared and w not in self.grad_bufs:  # a worker sharing memory needs neither
                self.grad_bufs[w] = self._shard().new_buffer()
                self.reply_bufs[w] = self._shard().new_buffer()
            return {"ints": (self.version,), "flat": self._snapshot(w), "meta": {"shared": shared}}

    def _attach(self, w: int, offer: Any) -> bool:
        """Map the files worker ``w`` offered (lock held); False keeps its shard on the wire."""
        self.shared.pop(w, None)
        if not self.shared_memory or not isinstance(offer, dict):
            return False
        nbytes = self._shard().nbytes
        grads = attach(offer.get("grads"), nbytes, offer.get("token"))
        params = attach(offer.get("params"), nbytes) if grads is not None else None
        if grads is None or params is None:
            log.debug("ps task %d: %s's shared memory is not on this host; its shard travels on the wire",
                      self.ps_index, self.who(w))
            return False
        self.shared[w] = (grads, params)
        return True

    def _initialise(self, meta: dict[str, Any], flat: torch.Tensor | None) -> None:
        specs = [meta["signature"][i] for i in meta["shard"]]
        layout = FlatLayout(specs)
        if flat is None or flat.numel() != layout.nbytes:
            raise RequestError(f"the chief sent {0 if flat is None else flat.numel()} bytes of parameters to ps "
                               f"task {self.ps_index}, its shard needs {layout.nbytes}.")
        self.params_buf = flat.clone()
        self.params = [torch.nn.Parameter(v) for v in layout.views(self.params_buf)]
        self.sum_buf = layout.new_buffer()
        self.round_buf = self.params_buf.clone()
        self.present = [False] * len(specs)
        self.optimizer = build_optimizer(meta["optimizer"], self.params, self.ps_index)
        self.exact_kernels = bool(isinstance(meta["optimizer"], dict) and meta["optimizer"].get("exact"))
        self.signature, self.layout = list(meta["signature"]), layout
        self.segment_sizes = [b - a for a, b, _ in layout.segments(SEGMENT_MIN_BYTES)]
        log.info("ps task %d holds %d parameter(s), %.1f MB, optimizer %s, mode %s", self.ps_index, len(specs),
                 layout.nbytes / 1e6, type(self.optimizer).__name__ if self.optimizer else None, self.mode)

    def _snapshot(self, w: int) -> torch.Tensor:
        """A copy of the parameters to send to ``w`` once the lock is released (lock held)."""
        buf = self.shared[w][1].tensor if w in self.shared else self.reply_bufs[w]
        buf.copy_(self.params_buf)
        return buf

    def _shard(self) -> FlatLayout:
        """The registered shard's layout; a request before registration is refused."""
        if self.layout is None:
            raise RequestError(f"ps task {self.ps_index} has no parameters yet: call strategy.prepare(model, "
                               "optimizer) first.", Status.BAD_INPUT)
        return self.layout

    def _push(self, w: int, msg: Message) -> dict[str, Any]:
        mask, hyper = (msg.meta or {}).get("mask"), (msg.meta or {}).get("hyper")
        units = (msg.meta or {}).get("units") or unpack_unit(msg.ints)
        if msg.flat is None and w in self.shared:
            msg.flat = self.shared[w][0].tensor  # the worker wrote its gradients there before sending the push
        weight, packed = (msg.meta or {}).get("weight"), (msg.meta or {}).get("packed")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                                   or not 0 <= weight < float("inf")):
            raise RequestError(f"ps task {self.ps_index}: a push's weight must be a finite number >= 0 (DiLoCo: the "
                               f"examples of its window). Received: {weight!r}.", Status.BAD_INPUT)
        if msg.flat is None and packed is not None:  # a compressed DiLoCo change
            msg.flat = unpack_delta(packed, self._shard(), mask, self.grad_bufs.get(w), self.ps_index)
        tree = (msg.meta or {}).get("tree")  # bitwise=True: the worker's subtrees, summed here in one device's order
        with self.cond:
            if self.mode == "async":
                grads = self._shard().views(flat_values(msg))
                if self.staleness is not None:
                    self.wait(lambda: self._lead(w) <= self.staleness, f"push (staleness {self.staleness})",
                              lambda: [u for u in self.active() - {w}
                                       if self.worker_versions[w] - self.worker_versions[u] > self.staleness])
                self.max_lead = max(self.max_lead, self._lead(w))
                self._set_hyper(hyper)
                for i, p in enumerate(self.params):
                    p.grad = grads[i] if mask is None or mask[i] else None
                    if p.grad is not None and weight is not None:
                        p.grad.mul_(float(weight))  # a DiLoCo change applied alone: scaled by 1/workers
                self._step([w])
                if units and self.dispatcher is not None:
                    self.dispatcher.applied(w, units)
                # The reply reads the parameters in place, after the lock is released: like TF's unlocked
                # variable reads in async training, it may mix in part of another worker's concurrent update.
                # Copying a snapshot first cost one pass over the shard per push (measured: BENCHMARKS.md).
                return {"ints": (self.version, self.worker_versions[w], len(self.dead)), "flat": self.params_buf}
            my_round = self.round
            self._set_hyper(hyper)
            if tree is not None or self.tree.active:
                self._check_tree_push(w, tree, weight)
                self.tree.add(self.who(w), tree, msg.flat, self._shard().nbytes)
            regions, sums = ([], []) if tree is not None else (self._shard().region_views(flat_values(msg)),
                                                                 self._shard().region_views(self.sum_buf))
            if weight is not None:  # DiLoCo: the round applies the live workers' changes averaged by their weights
                self.round_weight = float(weight) + (self.round_weight or 0.0) if self.arrivals else float(weight)
            for s, g in zip(sums, regions):
                if weight is not None:
                    s.copy_(g).mul_(float(weight)) if not self.arrivals else s.add_(g, alpha=float(weight))
                else:
                    s.copy_(g) if not self.arrivals else s.add_(g)
            self.present = [a or mask is None or bool(mask[i]) for i, a in enumerate(self.present)]
            self.arrivals.add(w)
            if units and self.dispatcher is not None:  # the round applies an arrival whatever happens to w
                self.dispatcher.applied(w, units)
            self.progress()
            self.wait(lambda: self.round != my_round, f"sync round {my_round}",
                      lambda: self.active() - self.arrivals)
            # One copy per round, shared by its replies: the next round cannot finish before they are
            # all received, but set_params (a checkpoint load) may change params_buf meanwhile.
            return {"ints": (self.version, self.worker_versions[w], len(self.dead)), "flat": self.round_buf}

    def _check_tree_push(self, w: int, tree: Any, weight: Any) -> None:
        """A bitwise push joins a round of bitwise pushes only (lock held)."""
        if tree is None or weight is not None or (self.arrivals and not self.tree.active):
            raise RequestError(f"ps task {self.ps_index}: {self.who(w)} mixes bitwise and plain pushes in sync round "
                               f"{self.round}. Build ParameterServerStrategy with the same bitwise= on every worker.",
                               Status.BAD_INPUT)

    def _lead(self, w: int) -> int:
        others = [self.worker_versions[u] for u in self.active() if u != w]
        return self.worker_versions[w] - min(others) if others else 0

    def _apply_round(self) -> None:
        if self.tree.active:  # bitwise: the workers' subtrees summed over the tree into the round's gradient
            try:
                self.tree.total_into(self._shard(), self.sum_buf)
            except RequestError as exc:  # every worker of the round hears it, not only the last to arrive
                self.failure = str(exc)
                self.cond.notify_all()
                raise
        grads = self._shard().views(self.sum_buf)
        if self.round_weight is not None:  # weighted changes: their average (no weight at all: no step)
            for s in self._shard().region_views(self.sum_buf):
                s.div_(self.round_weight) if self.round_weight > 0 else s.zero_()
            if self.round_weight <= 0:
                self.present = [False] * len(self.params)
            self.round_weight = None
        for i, p in enumerate(self.params):
            p.grad = grads[i] if self.present[i] else None
        self._step(sorted(self.arrivals))
        self.round_buf.copy_(self.params_buf)
        self.round += 1
        self.arrivals.clear()
        self.present = [False] * len(self.params)

    def _step(self, workers: list[int]) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.version += 1
        for u in workers:
            self.worker_versions[u] += 1
        self.cond.notify_all()  # staleness waits depend on the versions

    def _set_hyper(self, hyper: list[dict[str, Any]] | None) -> None:
        if hyper and self.optimizer is not None:
            for group, values in zip(self.optimizer.param_groups, hyper):
                group.update({k: v for k, v in values.items() if k != "params" and k not in KERNEL_KEYS})


def flat_values(msg: Message) -> torch.Tensor:
    """The tensor a request must carry; a request without one is refused."""
    if msg.flat is None:
        raise RequestError(f"a {Op.NAMES.get(msg.op, msg.op)} request carries no tensor; expected the shard's "
                           "values. The worker and the ps run different towers versions, or the peer is foreign.",
                           Status.BAD_INPUT)
    return msg.flat
