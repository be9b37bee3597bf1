"""``FaultTolerantStrategy(bitwise=True)``: one device's bits over replica groups that come and go.

Each step's global batch is cut into micro-batches and shared out over the step's quorum in whole
micro-batches; each group sums its micro-batches' gradients into the largest subtrees of the fixed
tree that lie within its share (``_bitwise.py``), and the groups exchange those subtrees whole in
an all-reduce of zero-padded blocks through torchft's manager (each element gets one value and
zeros: exact in any order). Every group then sums the top of
the tree alike. A step that loses a group does not commit; the survivors retry the same global
batch, now split over fewer groups, and sum the same tree: the same bits. A restarted group heals
from a live peer, an exact copy. So a job killed and healed ends with the uninterrupted run's bits.
Groups of one process, replicated: a group of several sums inside itself first, in torch's order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from towers.data import find_batch_info
from towers.strategies._bitwise import BitwiseSteps
from towers.strategies._bitwise_run import run_micro_batches
from towers.strategies._bitwise_setup import bitwise_steps, deterministic_kernels

__all__ = ["BitwiseGroups"]


class BitwiseGroups:
    """Held by a ``FaultTolerantStrategy`` built with ``bitwise=True``: its steps run micro-batch by micro-batch."""

    @staticmethod
    def check(bitwise: Any, micro_batch_size: Any, *, shard: bool, group_size: int) -> Callable[..., BitwiseSteps] | None:
        """``bitwise_steps`` for a fault-tolerant job, before anything connects (None: bitwise off).

        Raises:
            ValueError: groups of several processes or sharded ones (they sum inside the group in torch's order).
        """
        refused = ("shard=True: FSDP2 reduce-scatters inside the group in its own order" if shard else
                   f"group_size={group_size}: a group's processes sum their gradients in torch's order" if group_size > 1
                   else None)
        return bitwise_steps(bitwise, micro_batch_size, strategy="FaultTolerantStrategy", precision="32",
                             refused=refused)

    def __init__(self, strategy: Any, build: Callable[..., BitwiseSteps]):
        self._strategy = strategy
        self.steps: BitwiseSteps = build(0, 1, strategy.gather, exchange=self._exchange)
        self.last = True  # whether the micro-batch in progress is this group's last of the step (the optimizer steps)
        deterministic_kernels(strategy.device)

    def _exchange(self, block: torch.Tensor) -> torch.Tensor:
        """Every live group's ``block`` stacked in quorum order: a zero-padded all-reduce through torchft's manager (each
        element one group's value plus zeros: exact). A group lost meanwhile leaves garbage, and the step does not
        commit (the vote says so), as the plain all-reduce does; nothing is raised inside the backward."""
        from torch.distributed import ReduceOp

        n, me, width = self._strategy.live_replicas, self._strategy.replica_id, block.shape[0]
        if n == 1:
            return block
        slab = block.new_zeros((n * width, block.shape[1]))
        slab[me * width:(me + 1) * width] = block
        self._strategy._quorum.manager.allreduce(slab, reduce_op=ReduceOp.SUM).wait()
        return slab

    def watch(self, model: nn.Module) -> None:
        """Collect ``model``'s gradients micro-batch by micro-batch (in place of the flat all-reduce)."""
        self.steps.watch(model)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            context: Callable[[Any, int | None], Any]) -> Any:
        """The step in the quorum the strategy joined: ``fn`` per micro-batch of this group's share, over the tree."""
        strategy = self._strategy
        batch = find_batch_info(args, kwargs)
        self.steps.set_replicas(strategy.replica_id, strategy.live_replicas)

        def step_context(last: bool, leaf: int | None, count: int) -> contextlib.AbstractContextManager[None]:
            self.last = last
            shares = None if batch is None else -(-batch.examples_per_update // self.steps.micro_batch_size)
            return strategy._entered(context(batch, shares))  # the step's micro-batches share a regularization term

        try:
            return run_micro_batches(self.steps, batch, fn, args, kwargs, replica_id=strategy.replica_id,
                                     device=strategy.device, step_context=step_context)
        finally:
            self.last = True

