"""``ParameterServerStrategy(mode="sync", bitwise=True)``: one device's maths bit for bit, summed at the ps tasks.

Each worker runs its share of the global batch micro-batch by micro-batch (the shares are whole
micro-batches: ``split_unit``) and sums their gradients into the largest subtrees of the fixed tree over
the batch's micro-batches that lie within its share (``strategies/_bitwise.py``). ``optimizer.step()``
pushes those subtrees, each ps task its shard of each, with their places in the tree; the ps sums the
top of the tree in the one order a single device does (``tree_round.py``), whatever order the pushes
arrive in, and its optimizer steps on one device's gradient. Every worker pulls the same parameters.
On a worker ``p.grad`` holds its share's sum, as without bitwise. Under ``HybridStrategy`` the dense
subtrees are exchanged among the workers instead, as ``MirroredStrategy(bitwise=True)`` does.

Not kept exact, so refused: ``async`` and DiLoCo rounds (updates from one worker's share or window),
``ShardedEmbedding`` tables (rows summed in arrival order), and a worker lost mid-job (its micro-batches
are in no one's tree: the job fails, named, and a restart from a checkpoint resumes the same bits).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from towers.data import find_batch_info
from towers.errors import user_error
from towers.strategies._bitwise import BitwiseSteps
from towers.strategies._bitwise_run import run_micro_batches
from towers.strategies._bitwise_setup import bitwise_steps, deterministic_kernels
from towers.strategies._bitwise_tree import Grads
from towers.strategies.base import ReplicaContext

__all__ = ["BitwisePushes", "SubtreePush"]


class SubtreePush:
    """One step's subtrees at ``nodes`` of a tree over ``num_leaves`` micro-batches, laid out at once shard by shard
    for ``bound``'s push (a copy: ``.grad`` may alias a subtree, and a weighted loss divides ``.grad`` in place)."""

    def __init__(self, values: list[Grads], params: list[nn.Parameter], nodes: list[tuple[int, int]], num_leaves: int,
                 bound: Any):
        index = {id(p): k for k, p in enumerate(params)}
        self.meta: dict[str, Any] = {"nodes": [list(n) for n in nodes], "leaves": num_leaves}
        self._rows: dict[int, tuple[list[torch.Tensor], list[bool]]] = {}  # ps task -> (pieces, mask)
        for p in bound.active:
            shard, layout = [bound.params[i] for i in bound.shards[p]], bound.layouts[p]
            rows = torch.zeros(len(values) * layout.nbytes, dtype=torch.uint8)
            pieces: list[torch.Tensor] = []
            for k, value in enumerate(values):
                row = rows[k * layout.nbytes:(k + 1) * layout.nbytes]
                for view, param in zip(layout.views(row), shard):
                    if id(param) in index:
                        view.copy_(value.tensors[index[id(param)]])
                pieces += [row[a:b] for a, b, _ in bound.segments[p]]  # cut as a plain push is, row by row
            self._rows[p] = (pieces, [id(param) in index for param in shard])

    def shard_rows(self, p: int) -> tuple[list[torch.Tensor], list[bool]]:
        """The pieces of the push to ps task ``p`` (one row of its layout per subtree), and which of its parameters
        have a gradient (a frozen one has none)."""
        return self._rows[p]


class BitwisePushes:
    """Held by a ``ParameterServerStrategy`` built with ``bitwise=True``: its steps run micro-batch by micro-batch and
    its pushes carry subtrees."""

    @staticmethod
    def check(bitwise: Any, micro_batch_size: Any, *, mode: str, precision: str) -> Callable[..., BitwiseSteps] | None:
        """``bitwise_steps`` for a ps job, before anything connects (None: bitwise off).

        Raises:
            ValueError: a mode whose updates are not one device's (``async``, DiLoCo).
        """
        refused = (f"mode={mode!r}: each update there is one worker's share or window, not the global batch's"
                   if mode != "sync" else None)  # (overlap is async's only)
        return bitwise_steps(bitwise, micro_batch_size, strategy="ParameterServerStrategy", precision=precision,
                             refused=refused)

    def __init__(self, strategy: Any, build: Callable[..., BitwiseSteps], *, dense_group: Any = None,
                 pushes: bool = True):
        """``pushes``: the subtrees go to the ps tasks; else (``HybridStrategy``) the workers exchange them over
        ``dense_group`` (Mirrored's chunked all-to-all) and every worker steps its own optimizer on the tree's sum."""
        self._strategy, self.pushes = strategy, pushes
        self.steps: BitwiseSteps = build(strategy.replica_id, strategy.num_replicas_in_sync, strategy.gather,
                                         group=dense_group, deliver=self._keep if pushes else None)
        self._pending: SubtreePush | None = None
        self._bound: Any = None  # the model bound to the ps tasks (``worker.BoundModel``), once watched
        self.last = True  # whether the micro-batch in progress is the step's last here (the optimizer pushes then)
        deterministic_kernels(strategy.device)

    @staticmethod
    def refuse_tables(has_tables: bool) -> None:
        """Refuse a model with ``ShardedEmbedding`` tables (their rows are summed at the ps in arrival order).

        Raises:
            ValueError: naming the fix.
        """
        if has_tables:
            raise user_error("ParameterServerStrategy(bitwise=True) sums dense gradients over the tree; the rows of "
                             "ShardedEmbedding tables are summed at the ps in arrival order", "a model with tables",
                             "Use nn.Embedding under bitwise=True (a dense gradient), or turn bitwise off.")

    def watch(self, model: nn.Module, bound: Any) -> None:
        """Collect ``model``'s gradients micro-batch by micro-batch; ``bound``'s pushes then carry the subtrees (and
        its registration asks the ps for torch's own optimizer kernel, as one device steps)."""
        self.steps.watch(model)
        bound.tree, self._bound = self, bound

    def _keep(self, values: list[Grads], nodes: list[tuple[int, int]], num_leaves: int) -> None:
        self._pending = SubtreePush(values, self.steps._params, nodes, num_leaves, self._bound)

    def divisor(self, reduce: Callable[[str, Any], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sum over workers ``UpdateWeights.finish`` divides by, noted for the push: the ps divides the tree's sum
        by the update's global weight (``compute_average_loss(..., weights=...)``), as one device divides its gradient."""

        def reduce_sum(weight: torch.Tensor) -> torch.Tensor:
            total = reduce("sum", weight)
            if self._pending is not None and float(total.reshape(-1)[0]) > 0:
                self._pending.meta["divide"] = float(total.reshape(-1)[0])
            return total

        return reduce_sum

    def take(self) -> SubtreePush:
        """The step's subtrees for the push ``optimizer.step()`` makes now (forgotten after).

        Raises:
            RuntimeError: no step ran through ``strategy.run`` since the last push.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            raise user_error("Under ParameterServerStrategy(bitwise=True) optimizer.step() pushes the micro-batches "
                             "of the step strategy.run just ran", "an optimizer.step() with no backward in "
                             "strategy.run since the last one", "Call loss.backward() and optimizer.step() inside "
                             "the step function you pass to strategy.run.", cls=RuntimeError)
        return pending

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The step: ``fn`` per micro-batch of this worker's share; the optimizer pushes after the last one.

        Raises:
            ValueError: a batch that is not this worker's own share (after a worker was lost, or foreign).
        """
        strategy = self._strategy
        strategy._own_random_stream()  # (the micro-batches' draws are keyed; the script's stream stays the replica's)
        batch = find_batch_info(args, kwargs)
        if batch is not None and batch.unit is not None and int(batch.unit[2]) != strategy.replica_id:
            raise user_error("Under bitwise=True every worker computes its own share of each global batch",
                             f"worker {strategy.replica_id} handed share {batch.unit[2]} of batch {batch.unit[1]}",
                             "A worker was lost: restart the job from its last checkpoint (the same bits at any "
                             "worker count).")
        outer = strategy._replica_context(batch)  # notes the step's batch for the push (its unit, an empty share)
        leaves = None if batch is None else -(-batch.examples_per_update // self.steps.micro_batch_size)

        def step_context(last: bool, leaf: int | None, count: int) -> contextlib.AbstractContextManager[None]:
            self.last = last
            return strategy._entered(ReplicaContext(
                strategy, global_batch_size=outer.global_batch_size, accumulation_steps=outer.accumulation_steps * count,
                gradient_shares=leaves, num_padding_examples=outer.num_padding_examples if leaf is None else 0,
                is_update_step=outer.is_update_step and last))

        try:
            return run_micro_batches(self.steps, batch, fn, args, kwargs, replica_id=strategy.replica_id,
                                     device=strategy.device, step_context=step_context)
        finally:
            self.last = True
