"""The fixed binary tree ``bitwise=True`` sums over: its nodes, a node's sum from the nodes known, and the values
it adds (a gradient per parameter, added elementwise). Pure maths, no communication (``_bitwise.py`` runs the steps).

Leaves are a global batch's micro-batches, at level 0; ``node(l, i) = node(l-1, 2i) + node(l-1, 2i+1)``, left +
right; a node wholly past the last leaf is zeros (the tree is over the next power of two). Whoever holds a node's
value, summed anywhere, holds the same bits: the sum is elementwise and its order is the tree's.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from towers.errors import FailedPreconditionError

#: A tree node's value: a tensor (a flat gradient, a loss) or a leaf's gradients (``Grads``); anything with ``+``.
Node = TypeVar("Node", torch.Tensor, "Grads")

__all__ = ["Grads", "Node", "dyadic_nodes", "root_sum", "tree_sum"]


def _levels(num_leaves: int) -> int:
    return max(0, (num_leaves - 1).bit_length())  # the tree over the next power of two


def dyadic_nodes(start: int, end: int) -> list[tuple[int, int]]:
    """The ``(level, index)`` tree nodes that exactly cover leaves ``[start, end)``, largest first, left to right."""
    nodes, i = [], start
    while i < end:
        level = 0
        while i % (2 ** (level + 1)) == 0 and i + 2 ** (level + 1) <= end:
            level += 1
        nodes.append((level, i >> level))
        i += 2 ** level
    return nodes


def tree_sum(known: dict[tuple[int, int], Node], level: int, index: int, num_leaves: int,
             zeros: Callable[[], Node]) -> Node:
    """Node ``(level, index)`` of the tree over ``num_leaves`` leaves: from ``known`` where it is there, else its two
    children's sum (left + right); a node wholly past the last leaf is zeros."""
    if (level, index) in known:
        return known[(level, index)]
    if index * 2 ** level >= num_leaves:
        return zeros()
    if level == 0:
        raise FailedPreconditionError(f"bitwise: leaf {index} of {num_leaves} is missing from the tree")
    return (tree_sum(known, level - 1, 2 * index, num_leaves, zeros)
            + tree_sum(known, level - 1, 2 * index + 1, num_leaves, zeros))


def root_sum(known: dict[tuple[int, int], Node], num_leaves: int, zeros: Callable[[], Node]) -> Node:
    """The whole tree's sum over ``num_leaves`` leaves from the nodes in ``known`` (``tree_sum`` of the root)."""
    return tree_sum(known, _levels(num_leaves), 0, num_leaves, zeros)



class Grads:
    """A leaf's (or a tree node's) gradients, one tensor per parameter, added elementwise by torch's foreach add: the
    same bits as one flat add, without first copying every gradient into one flat tensor."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors

    def __add__(self, other: "Grads") -> "Grads":
        return Grads(list(torch._foreach_add(self.tensors, other.tensors)))
