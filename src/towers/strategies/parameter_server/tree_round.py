"""A sync round of ``bitwise=True`` pushes at a ps task: one device's sum, whatever order the pushes arrive in.

Each worker computes its share of the global batch micro-batch by micro-batch and sums their gradients
into the largest subtrees of the fixed binary tree over the batch's micro-batches that lie within its
share (``strategies/_bitwise.py``). Its push carries those subtrees, one row of the shard each, with
their places in the tree. The round's gradient is the tree's sum over every worker's subtrees, the
top levels added here left + right: the order one device adds them in, so the ps's optimizer sees one
device's gradient bit for bit. A worker lost in such a round leaves micro-batches no one computed:
the job fails, named (``server.py``), rather than training on a different sum.
"""

from __future__ import annotations

from typing import Any

import torch

from towers.errors import FailedPreconditionError
from towers.strategies._bitwise_tree import Grads, root_sum
from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.sharding import FlatLayout
from towers.strategies.parameter_server.transport import Status

__all__ = ["TreeRound"]


class TreeRound:
    """The subtrees of the sync round in progress at ps task ``ps_index`` (under the server's lock)."""

    def __init__(self, ps_index: int):
        self.ps_index = ps_index
        self.rows: dict[tuple[int, int], torch.Tensor] = {}  # tree node (level, index) -> that node's shard bytes
        self.num_leaves: int | None = None
        self.divide = 1.0  # the round's sum is divided by this (compute_average_loss(..., weights=...)); 1: not at all
        self.seen = False  # a bitwise push arrived in this job: a lost worker then fails it (its leaves are gone)

    def add(self, who: str, tree: Any, flat: torch.Tensor | None, nbytes: int) -> None:
        """Keep a push's subtrees (``tree``: its ``nodes`` and the batch's ``leaves``; ``flat``: one shard per node).

        Raises:
            RequestError: a malformed push, a node already pushed, or another tree size than the round's.
        """
        try:
            nodes = [(int(level), int(index)) for level, index in tree["nodes"]]
            leaves = int(tree["leaves"])
            divide = float(tree.get("divide", 1.0))  # a weighted loss: the update's global weight
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"ps task {self.ps_index}: {who} sent a malformed bitwise push ({exc}).",
                               Status.BAD_INPUT) from exc
        size = 0 if flat is None else flat.numel() * flat.element_size()
        if size != len(nodes) * nbytes:
            raise RequestError(f"ps task {self.ps_index}: {who}'s bitwise push carries {size} B for {len(nodes)} "
                               f"subtree(s) of {nbytes} B.", Status.BAD_INPUT)
        if self.num_leaves is not None and leaves != self.num_leaves:
            raise RequestError(f"ps task {self.ps_index}: {who} pushed a tree over {leaves} micro-batches into a round "
                               f"over {self.num_leaves}: the workers are on different global batches. Every worker "
                               "must iterate the same strategy.distribute_dataset(...) in step.", Status.BAD_INPUT)
        if self.num_leaves is not None and divide != self.divide:
            raise RequestError(f"ps task {self.ps_index}: {who} divides the round's gradient by {divide:g}, another "
                               f"worker by {self.divide:g}.", Status.BAD_INPUT)
        self.seen, self.num_leaves, self.divide = True, leaves, divide
        raw = None if flat is None else flat.view(torch.uint8)
        for k, node in enumerate(nodes):
            if node in self.rows:
                raise RequestError(f"ps task {self.ps_index}: {who} pushed tree node {node} twice in one round.",
                                   Status.BAD_INPUT)
            assert raw is not None
            self.rows[node] = raw[k * nbytes:(k + 1) * nbytes]

    @property
    def active(self) -> bool:
        """Whether the round in progress is a bitwise one."""
        return self.num_leaves is not None

    def total_into(self, layout: FlatLayout, out: torch.Tensor) -> None:
        """Write the tree's sum into ``out`` (the round's gradient buffer) and start the next round.

        Raises:
            RequestError: a micro-batch of the batch is missing (a worker pushed none of it).
        """
        leaves, rows = self.num_leaves or 0, self.rows
        self.rows, self.num_leaves = {}, None
        known = {node: Grads(layout.views(row)) for node, row in rows.items()}
        try:
            total = root_sum(known, leaves, lambda: Grads([torch.zeros_like(v) for v in layout.views(out)]))
        except FailedPreconditionError as exc:
            raise RequestError(f"ps task {self.ps_index}: the round's tree is incomplete ({exc}).") from exc
        for view, value in zip(layout.views(out), total.tensors):
            view.copy_(value)
            if self.divide != 1.0:  # as one device divides p.grad (UpdateWeights.finish): the same bits
                view.div_(self.divide)
        self.divide = 1.0
