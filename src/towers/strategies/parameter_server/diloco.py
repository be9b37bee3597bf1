"""DiLoCo on the parameter servers: H inner steps on each worker, then one outer step on the ps tasks.

A worker steps its own (inner) optimizer on its share of each global batch, as if it trained alone: the
gradient ``compute_average_loss`` leaves (a sum over the GLOBAL batch) is scaled to this worker's mean before
the inner step, so an inner step is what one device would take on the worker's share. Every ``sync_every``
steps, and at the end of every pass of a dataset handed out by ps task 0, it pushes its parameter change
since the last outer step (the global values minus its own: the "pseudo-gradient") as a push's gradient.
The ps tasks hold the global parameters and step the outer optimizer on the change (a sync round averages
the live workers' changes, weighted by the examples each trained; an async one applies each on arrival,
scaled by 1/workers), and the reply is the new global values, which the worker takes up and trains on.

With ``fragments=F`` outer step ``k`` carries fragment ``k % F`` of the parameters only (contiguous groups of
the model's parameters of about equal bytes): the others keep training locally (Streaming DiLoCo, without
overlap). The batches of a window count as applied (ps task 0's dispatcher, the ledger) when its outer push
arrives: a worker that dies mid-window has its window's batches handed out again.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from towers._logging import get_logger
from towers.data import BatchInfo
from towers.errors import InvalidArgumentError, user_error
from towers.strategies._copies import DetachedHook
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.diloco_codec import DeltaEncoder
from towers.strategies.parameter_server.diloco_options import DiLoCoOptions
from towers.strategies.parameter_server.dispatch import FLUSH
from towers.strategies.parameter_server.sharding import ParamSpec
from towers.strategies.parameter_server.transport import Op
from towers.strategies.parameter_server.worker import BoundModel
from towers.verify_capture import before_update

__all__ = ["DiLoCo", "DiLoCoOptimizer", "split_fragments"]

log = get_logger(__name__)


def split_fragments(specs: list[ParamSpec], fragments: int) -> list[set[int]]:
    """Return ``fragments`` sets of parameter indices: contiguous runs of the model's parameters, about equal bytes.

    Raises:
        ValueError: the model has fewer parameters than ``fragments`` (some fragment would be empty).
    """
    n = len(specs)
    if fragments > n:
        raise user_error(f"fragments={fragments} cannot divide a model of {n} parameter tensor(s): every fragment "
                         "needs at least one", f"fragments={fragments}",
                         f"Use fragments <= {n} (fragments=1 syncs the whole model at every outer step).")
    total = sum(s.nbytes for s in specs) or 1
    out: list[set[int]] = [set() for _ in range(fragments)]
    k, cumulative = 0, 0
    for i, spec in enumerate(specs):
        # move to the next fragment once this one has its share of bytes, keeping one parameter per later fragment
        if out[k] and k < fragments - 1 and (cumulative >= (k + 1) * total / fragments or n - i <= fragments - 1 - k):
            k += 1
        out[k].add(i)
        cumulative += spec.nbytes
    return out


class DiLoCo:
    """A ``ParameterServerStrategy``'s DiLoCo state on a worker: the options, the step's examples, the counts."""

    def __init__(self, options: DiLoCoOptions, *, num_workers: int):
        self.options, self.num_workers = options, num_workers
        self.optimizer: DiLoCoOptimizer | None = None  # the latest prepared model's
        self._local = 0  # this worker's real examples in the update being computed
        self._global: int | None = 0  # the update's global examples; None: a batch without accounting
        self._batches = 0  # micro-batches counted since the last step
        #: totals over the job: examples this worker trained, inner and outer steps, bytes its outer pushes sent
        self.examples = self.inner_steps = self.outer_steps = self.outer_bytes_sent = 0
        self.outer_wait_s = 0.0  # time this worker spent in outer pushes (sending, the ps's step, the reply)

    def note_batch(self, batch: BatchInfo | None) -> None:
        """Count the examples of a step's batch (``strategy.run`` calls it for every micro-batch)."""
        if batch is None or self._global is None:
            self._global = None
            return
        if self._batches >= batch.batches_per_update:  # a new update: the last batches had no step (evaluation)
            self._local, self._batches = 0, 0
        self._batches += 1
        self._local += batch.local_batch_size - batch.num_padding_examples
        self._global = batch.examples_per_update

    def take_examples(self) -> tuple[int | None, float]:
        """This update's local examples (None: unknown) and the factor from a global-batch mean to this worker's."""
        local, total = self._local, self._global
        self._local, self._global, self._batches = 0, 0, 0
        if total is None:
            return None, 1.0
        return local, (total / local if local else 1.0)

    def check_model(self, sparse: Any, optimizer: torch.optim.Optimizer | None) -> "DiLoCo":
        """Return self when ``prepare``'s model and optimizer can train under DiLoCo.

        Raises:
            ValueError: the model has ``ShardedEmbedding`` tables (their rows are pushed every step), or no
                optimizer was given (the workers' inner steps need one).
        """
        if sparse is not None:
            raise user_error("mode='diloco' trains dense parameters; ShardedEmbedding rows live on the ps tasks and "
                             "are updated every step", f"a model with {len(sparse)} table(s)",
                             "Use HybridStrategy for a model with sharded tables, or nn.Embedding under DiLoCo.")
        if optimizer is None:
            raise user_error("mode='diloco' needs the workers' (inner) optimizer", "strategy.prepare(model) without one",
                             "Pass it: model, optimizer = strategy.prepare(model, torch.optim.AdamW(...)).")
        return self

    def refuse_weighted_loss(self) -> None:
        """Raise: an inner step takes this worker's mean over its examples, which a weighted loss does not give."""
        raise user_error("compute_average_loss(..., weights=...) is not available under mode='diloco': each worker's "
                         "inner step is normalised by its own examples", "a weighted loss",
                         "Normalise by examples: compute_average_loss(per_example_loss) with one loss per example.")

    def report(self, stats: dict[str, float]) -> None:
        """Log this worker's DiLoCo traffic at the end of the job (bytes per example)."""
        if self.inner_steps:
            log.info("diloco: %d inner step(s), %d outer step(s) (sync_every %d, %s), %d example(s); %.1f bytes sent "
                     "per example (%.0f of them in outer pushes)", self.inner_steps, self.outer_steps,
                     self.options.sync_every, self.options.compression, self.examples, stats["bytes_per_example"],
                     self.outer_bytes_sent / self.examples if self.examples else 0.0)

    def outer_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The outer optimizer over ``model``'s parameters: what the ps tasks rebuild and step."""
        return self.options.build_outer(model.parameters())

    def wrap(self, optimizer: torch.optim.Optimizer, bound: BoundModel, *,
             step_batches: Callable[[], tuple[bool, list[Any]]], replaced: Callable[[], bool]) -> "DiLoCoOptimizer":
        """Return the optimizer ``prepare`` hands out: ``optimizer`` steps locally, every H steps an outer step."""
        self.optimizer = DiLoCoOptimizer(optimizer, bound, self, step_batches=step_batches, replaced=replaced)
        return self.optimizer

    def dispatch(self, client: ParameterClient) -> Callable[[str, int, dict[str, Any]], dict[str, Any]]:
        """Return the batch dispatch of a DiLoCo worker: the end of a pass ends the window (every worker at the
        same step), and the pass ends only once every live worker's window is pushed (``flush``: ``dispatch.py``),
        so a worker that dies before it pushed has its window's batches trained by the others in the same pass."""
        def fetch_and_sync(key: str, step: int, spec: dict[str, Any]) -> dict[str, Any]:
            while True:
                answer = client.next_batches(key, step, {**spec, "flush": True})
                if answer.get("kind") != FLUSH:
                    break
                window = self.optimizer.window_units() if self.optimizer is not None else []
                unpushed = [u for u in answer["units"] if u not in window]
                if unpushed:  # an evaluation's units, handed in before the push: the others may wait on them
                    client.request(Op.DISPATCH, ps=[0], metas=[{"computed": unpushed}])
                if self.optimizer is not None:
                    self.optimizer.sync()
            # a worker holding no batch at the pass's end was not asked to flush: its window goes in the same round
            if answer.get("kind") == "stop" and self.optimizer is not None:
                self.optimizer.sync()
            return answer
        return fetch_and_sync

    def stats(self, bytes_sent: int) -> dict[str, float]:
        """Return the counts, and ``bytes_per_example``: ``bytes_sent`` (all of this worker's ps traffic) per example."""
        return {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "examples": self.examples,
                "outer_bytes_sent": self.outer_bytes_sent, "outer_wait_s": self.outer_wait_s,
                "bytes_per_example": bytes_sent / self.examples if self.examples else 0.0}


class DiLoCoOptimizer(torch.optim.Optimizer):
    """The user's (inner) optimizer stepped locally; every ``sync_every`` steps the change goes to the ps tasks."""

    def __init__(self, optimizer: torch.optim.Optimizer, bound: BoundModel, diloco: DiLoCo, *,
                 step_batches: Callable[[], tuple[bool, list[Any]]], replaced: Callable[[], bool]):
        self.optimizer, self._bound, self._diloco = optimizer, bound, diloco
        self._step_batches, self._replaced = step_batches, replaced
        self._building = True
        super().__init__(optimizer.param_groups, optimizer.defaults)  # shares the user's group dicts (LR schedulers)
        self._building = False
        self.state = optimizer.state
        options = diloco.options
        self._fragments = split_fragments(bound.signature, options.fragments)
        self._encoder = DeltaEncoder(options.compression)
        # the global values as of the last outer step (what a change is measured from); replies land in scratch
        self._anchor = [buf.clone() for buf in bound.param_bufs]
        self._anchor_views = [layout.views(b) for layout, b in zip(bound.layouts, self._anchor)]
        self._scratch = [layout.new_buffer() for layout in bound.layouts]
        self._scratch_views = [layout.views(b) for layout, b in zip(bound.layouts, self._scratch)]
        self._units: list[Any] = []  # the window's dispatched batches, its inner steps and its examples (the weight)
        self._steps, self._weight = 0, 0.0
        self._outer = 0
        bound.model.register_load_state_dict_post_hook(DetachedHook(lambda module, incompatible: self._reanchor()))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Take one inner step on this worker; after ``sync_every`` of them, one outer step. Return ``closure()``'s loss."""
        before_update(self)  # `towers verify` records the parameters here; nothing otherwise
        if self._replaced():
            raise user_error("ParameterServerStrategy holds one model at a time on its ps tasks, and a later "
                             "strategy.prepare(...) replaced the model this optimizer steps",
                             f"optimizer.step() of {type(self.optimizer).__name__} over the earlier model",
                             "Train one model after the other under mode='diloco'.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        empty, units = self._step_batches()
        local, scale = self._diloco.take_examples()
        if not empty and local != 0:
            if scale != 1.0:  # compute_average_loss divided by the global batch: make it this worker's mean
                grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale)
            self.optimizer.step()
        self._units.extend(units)
        self._steps += 1
        self._weight += 1.0 if local is None else float(local)
        self._diloco.inner_steps += 1
        self._diloco.examples += local or 0
        if self._steps >= self._diloco.options.sync_every:
            self.sync()
        return loss

    def window_units(self) -> list[Any]:
        """The dispatched batches (``[pass, global batch, replica]``) trained since the last outer step."""
        return [list(u) for u in self._units]

    def sync(self) -> None:
        """Push this worker's change since the last outer step and take up the new global values (no-op when the
        window is empty). Every worker calls it at the same inner step: at every ``sync_every``-th, and at the
        end of each pass of a dataset the ps tasks hand out."""
        if self._steps == 0:
            return
        bound, options = self._bound, self._diloco.options
        client = bound.client
        client.finish()
        fragment = self._fragments[self._outer % len(self._fragments)]
        weight = self._weight if options.outer_mode == "sync" else 1.0 / self._diloco.num_workers
        units, metas, flats = self._units, [], []
        for p in bound.active:
            meta: dict[str, Any] = {"weight": weight}
            mask = [i in fragment for i in bound.shards[p]]
            # the whole shard as float32: the push's flat buffer; a part of it, or compressed: packed values
            packed = options.compression != "float32" or not all(mask)
            deltas = []
            with torch.no_grad():
                for pos, i in enumerate(bound.shards[p]):
                    view = bound.grad_views[p][pos]
                    if not mask[pos]:
                        view.zero_()
                        continue
                    delta = self._anchor_views[p][pos] - bound.params[i].detach().to("cpu", view.dtype)
                    if packed:
                        deltas.append((i, delta))
                    else:
                        view.copy_(delta)
            if packed:
                meta["packed"] = self._encoder.pack(deltas)
            flats.append(None if packed else bound.grad_bufs[p])
            if not all(mask):
                meta["mask"] = mask
            if p == 0 and units:
                meta["units"] = units
            metas.append(meta)
        sent, began = sum(link.bytes_sent for link in client.links), time.perf_counter()
        replies = client.request(Op.PUSH, ps=bound.active, metas=metas, flats=flats,
                                 replies_into=[self._scratch[p] for p in bound.active])
        self._diloco.outer_bytes_sent += sum(link.bytes_sent for link in client.links) - sent
        self._diloco.outer_wait_s += time.perf_counter() - began
        if units and 0 not in bound.active:  # ps task 0 holds none of these parameters: tell it apart
            client.batches_applied(units)
        bound.note_replies(replies)
        with torch.no_grad():
            for p in bound.active:
                for pos, i in enumerate(bound.shards[p]):
                    if i in fragment:
                        self._anchor_views[p][pos].copy_(self._scratch_views[p][pos])
                        bound.params[i].copy_(self._scratch_views[p][pos])
        self._steps, self._weight, self._units = 0, 0.0, []
        self._outer += 1
        self._diloco.outer_steps += 1

    def _reanchor(self) -> None:
        """After ``model.load_state_dict`` (pushed to the ps tasks as the global values): measure changes from there."""
        with torch.no_grad():
            for p, shard in enumerate(self._bound.shards):
                for pos, i in enumerate(shard):
                    self._anchor_views[p][pos].copy_(self._bound.params[i].detach())
        self._encoder.reset()
        self._steps, self._weight = 0, 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients."""
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the ps tasks' shards are fixed at ``prepare``."""
        if not self._building:
            raise InvalidArgumentError("add_param_group after strategy.prepare() is not supported under "
                                       "mode='diloco'. Add every param group before calling prepare().")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state (the outer optimizer's lives on the ps tasks)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner optimizer's state."""
        self.optimizer.load_state_dict(state_dict)
