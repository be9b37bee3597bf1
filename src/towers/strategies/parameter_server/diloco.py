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

from typing import Any, Callable

import torch
from torch import nn

from towers._logging import get_logger
from towers.data import BatchInfo
from towers.errors import user_error
from towers.strategies.parameter_server.client import ParameterClient
from towers.strategies.parameter_server.diloco_optimizer import DiLoCoOptimizer, split_fragments
from towers.strategies.parameter_server.diloco_options import DiLoCoOptions
from towers.strategies.parameter_server.dispatch import FLUSH
from towers.strategies.parameter_server.transport import Op
from towers.strategies.parameter_server.worker import BoundModel

__all__ = ["DiLoCo", "DiLoCoOptimizer", "split_fragments"]

log = get_logger(__name__)


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

    def window_empty(self) -> bool:
        """True when no inner step was taken since the last outer step (the model holds the global values)."""
        return self.optimizer is None or self.optimizer.window_steps == 0

    def settle(self) -> None:
        """Read an overlapped outer push's reply now (``overlap=True``): the model takes up the global values."""
        if self.optimizer is not None:
            self.optimizer.settle()

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
                self.optimizer.settle()  # overlap: the pass ends on the global values
            return answer
        return fetch_and_sync

    def stats(self, bytes_sent: int) -> dict[str, float]:
        """Return the counts, and ``bytes_per_example``: ``bytes_sent`` (all of this worker's ps traffic) per example."""
        return {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps, "examples": self.examples,
                "outer_bytes_sent": self.outer_bytes_sent, "outer_wait_s": self.outer_wait_s,
                "bytes_per_example": bytes_sent / self.examples if self.examples else 0.0}
