"""``bitwise=True``'s exchange between replicas, in buckets that start while the last micro-batch's backward runs.

Each replica holds the largest subtrees of the fixed tree that lie within its share (``_bitwise_tree.py``);
every replica needs the tree's sum. The parameters are cut into buckets of about ``BUCKET_BYTES``, in the
reverse of their order (the order a backward tends to finish them, as DDP's buckets). For a bucket, an
all-to-all gives each replica every replica's subtrees of one chunk of the bucket, it sums the top of the
tree for that chunk, and an all-gather returns the chunks: the bytes of a ring all-reduce where a replica
holds one subtree. The sum is elementwise, so a chunk summed alone has the bits of the whole sum's.

A bucket's all-to-all starts as soon as the last micro-batch's backward has produced the gradients of all of
its parameters (and of every bucket before it: the buckets start in one order on every replica, which the
collectives need), so most of the exchange runs while the backward computes the rest, where it used to wait
for the backward's end. Parameters that backward does not reach start with the end of the backward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from towers.process_group import collective
from towers.strategies._bitwise_tree import dyadic_nodes, root_sum, tree_sum

__all__ = ["BUCKET_BYTES", "BucketedExchange"]

#: About this many bytes of gradient per bucket (DDP's default bucket is 25 MiB).
BUCKET_BYTES = 25 * 2 ** 20


class BucketedExchange:
    """The tree's sum of ``params``' gradients over ``num_replicas`` replicas of ``group``, bucket by bucket."""

    def __init__(self, params: list[nn.Parameter], num_replicas: int, group: Any = None,
                 bucket_bytes: int | None = None):
        self._params, self._n, self._group = params, num_replicas, group
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self._buckets: list[list[int]] = []  # parameter indices, in the order the buckets start
        for i in reversed(range(len(params))):
            nbytes = params[i].numel() * params[i].element_size()
            if not self._buckets or sum(params[j].numel() * params[j].element_size()
                                        for j in self._buckets[-1]) + nbytes > bucket_bytes:
                self._buckets.append([])
            self._buckets[-1].append(i)
        self.num_params = len(params)
        self._ready: set[int] = set()
        self._started: list[tuple[list[int], torch.Tensor, Any, int]] = []  # bucket, received, its work, its size
        self._ranges: list[tuple[int, int]] = []
        self._num_leaves = 0
        self._rank = 0

    def begin(self, ranges: list[tuple[int, int]], rank: int) -> None:
        """The last micro-batch of this replica's share starts: every replica's leaves are ``ranges``."""
        self._ranges, self._num_leaves, self._rank = ranges, ranges[-1][1], rank
        self._ready, self._started = set(), []

    def ready(self, index: int, leaves: Callable[[int], dict[tuple[int, int], torch.Tensor]]) -> None:
        """Parameter ``index``'s gradient of the last micro-batch is done (``leaves(i)``: parameter ``i``'s gradient of
        every leaf of this share, by tree node): start every bucket whose gradients are all done, in order."""
        self._ready.add(index)
        while len(self._started) < len(self._buckets) and self._ready.issuperset(self._buckets[len(self._started)]):
            self._start(self._buckets[len(self._started)], leaves)

    def finish(self, leaves: Callable[[int], dict[tuple[int, int], torch.Tensor]]) -> list[torch.Tensor]:
        """Start the buckets left (their parameters' gradients are all done now), then return the tree's sum of every
        parameter's gradient, the same bits on every replica."""
        while len(self._started) < len(self._buckets):
            self._start(self._buckets[len(self._started)], leaves)
        totals: list[torch.Tensor | None] = [None] * len(self._params)
        started, self._started = self._started, []
        gathers = []
        for bucket, received, work, _ in started:
            with collective("bitwise: every replica's subtrees, one chunk to each replica"):
                work.wait()
            zeros = received.new_zeros(received.shape[-1])  # a node past the last leaf (never written to)
            rows = {node: row for r in range(self._n) for node, row in zip(self._nodes(r), received[r].unbind())}
            mine = root_sum(rows, self._num_leaves, lambda z=zeros: z)  # type: ignore[misc]
            whole = mine.new_empty(self._n * mine.numel())
            with collective("bitwise: the tree's sum, chunk by chunk"):
                gathers.append((bucket, whole, dist.all_gather_single(whole, mine, group=self._group, async_op=True)))
        for bucket, whole, work in gathers:
            with collective("bitwise: the tree's sum, chunk by chunk"):
                work.wait()
            offset = 0
            for i in bucket:
                p = self._params[i]
                totals[i] = whole[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return [t for t in totals if t is not None]

    def _nodes(self, rank: int) -> list[tuple[int, int]]:
        return dyadic_nodes(*self._ranges[rank])

    def _start(self, bucket: list[int], leaves: Callable[[int], dict[tuple[int, int], torch.Tensor]]) -> None:
        """This replica's subtrees of ``bucket``, one flat row each (zero rows up to the widest replica's count), cut in
        one chunk per replica: the all-to-all that gives each replica its chunk of everyone's, started."""
        nodes, n = self._nodes(self._rank), self._n
        width = max(len(self._nodes(r)) for r in range(n))
        size = sum(self._params[i].numel() for i in bucket)
        chunk = -(-size // n)
        block = self._params[bucket[0]].new_zeros((width, n * chunk))
        offset = 0
        for i in bucket:
            p, known = self._params[i], leaves(i)
            zeros = torch.zeros_like(p)  # a node past the last leaf (never written to)
            for k, (level, index) in enumerate(nodes):
                block[k, offset:offset + p.numel()] = tree_sum(known, level, index, self._num_leaves,
                                                               lambda z=zeros: z).reshape(-1)  # type: ignore[misc]
            offset += p.numel()
        send = block.view(width, n, chunk).transpose(0, 1).contiguous()  # replica r's chunk of every subtree
        received = torch.empty_like(send)
        with collective("bitwise: every replica's subtrees, one chunk to each replica"):
            work = dist.all_to_all_single(received, send, group=self._group, async_op=True)
        self._started.append((bucket, received, work, size))
