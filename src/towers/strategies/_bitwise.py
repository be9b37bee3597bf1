"""``bitwise=True``: one device's maths bit for bit, at any replica count.

Float addition is not associative, so a gradient summed in another order has other bits: N replicas
that each sum their share and then all-reduce the shares train what one device trains only within
rounding. Here the order is fixed by the global batch alone:

- the global batch of ``B`` examples is cut into ``L = B / micro_batch_size`` micro-batches (the
  leaves), numbered over the whole batch; replica ``r`` of ``N`` computes its contiguous ``L / N``
  of them, one forward and backward each, so every kernel sees the same shapes at every ``N``;
- the update's gradient is the sum over a fixed binary tree of the leaves (``node(l, i) =
  node(l-1, 2i) + node(l-1, 2i+1)``, leaves at level 0, zeros past ``L`` up to a power of two);
  each replica computes the largest subtrees that lie within its leaves, and the replicas sum the
  nodes above them by the same formula, chunk by chunk (``_bitwise_buckets.py``: buckets that start
  during the last micro-batch's backward): the same bits on every replica, and the same as one
  process, which walks the same tree (``_bitwise_tree.py``);
- the losses a step logs (``strategy.reduce("sum", strategy.run(...))``) are summed over the same tree;
- random draws (dropout) are keyed by the micro-batch's place in the job (epoch, global batch, micro-batch),
  not by the replica that computes it.

The tree's result is written into ``p.grad`` at the end of the last micro-batch's backward, so
everything after it (towers' or torch's ``clip_grad_norm_``, the optimizer) sees one device's
gradient. The parameters themselves start equal (the chief's) and every update is computed from the
same bits, so they stay equal. Deterministic kernels on a GPU are the user's switch
(``torch.use_deterministic_algorithms``); this module fixes only the order of the sums.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from towers._logging import get_logger
from towers.errors import FailedPreconditionError, user_error
from towers.strategies._bitwise_buckets import BucketedExchange
from towers.strategies._bitwise_tree import Grads, Node, dyadic_nodes, root_sum, tree_sum

__all__ = ["BitwiseSteps"]

log = get_logger(__name__)


class BitwiseSteps:
    """The micro-batches of this replica's share and the tree their gradients are summed over (held by a synchronous
    strategy built with ``bitwise=True``)."""

    def __init__(self, micro_batch_size: int | None, *, rank: int, num_replicas: int,
                 gather: Callable[[torch.Tensor], torch.Tensor], group: Any = None,
                 exchange: Callable[[torch.Tensor], torch.Tensor] | None = None, lockstep: bool = False,
                 deliver: Callable[[list[Grads], list[tuple[int, int]], int], None] | None = None):
        self._micro_batch_size = micro_batch_size  # None: chosen from the first global batch (``check_batch_size``)
        #: ``gather(t)``: every replica's ``t`` concatenated on dim 0, in replica order (the strategy's ``gather``)
        self._rank, self._num_replicas, self._gather = rank, num_replicas, gather
        self._group = group  # the replicas' process group (None: the default one) for the gradients' exchange
        #: ``exchange(block)``: every replica's ``block`` (its subtrees, one per row) stacked in replica order, in
        #: place of the chunked all-to-all (a strategy whose collectives are its own: fault tolerance)
        self._exchange_rows = exchange
        self._buckets: BucketedExchange | None = None  # the exchange over ``group``, bucket by bucket (made at first use)
        #: ``deliver(values, nodes, num_leaves)``: hand this replica's subtree values (the tree nodes ``nodes`` of
        #: ``num_leaves``) to whoever sums the top of the tree (parameter servers); ``.grad`` then holds the share's sum
        self._deliver = deliver
        #: whether every replica runs as many micro-batches as the one with the most (a forward that takes part in
        #: collectives, as FSDP2's parameter all-gathers do); the extra ones train nothing
        self.lockstep = lockstep
        self._params: list[nn.Parameter] = []
        self._leaves: dict[int, Grads] = {}  # this update's leaves computed here: global index -> its gradients
        self._leaf: int | None = 0  # global index of the micro-batch whose backward runs now (None: an empty share's)
        self._num_leaves = 0
        self._ranges: list[tuple[int, int]] = []  # every replica's leaves [first, end) of the batch in progress
        #: what ``.grad`` held before the run's first backward (accumulation: earlier runs' trees), added back at the end
        self._carry: dict[int, torch.Tensor] = {}
        self._reached: set[int] = set()  # the parameters this backward reached
        self._last = False
        self._queued = False
        self._losses: list[tuple[int, torch.Tensor]] = []  # the micro-batches' scalar losses, by global leaf
        self._results: list[Any] = []  # what the step returned for each micro-batch
        self.last_result: torch.Tensor | None = None  # what run returned last: its leaves' losses reduce over the tree

    # --- set up -----------------------------------------------------------------------------------------
    def set_replicas(self, rank: int, num_replicas: int) -> None:
        """The replicas of the step about to run (a fault-tolerant job's live groups change from step to step)."""
        self._rank, self._num_replicas = rank, num_replicas

    def watch(self, model: nn.Module) -> None:
        """Collect ``model``'s gradients per micro-batch (a hook at the end of every backward that reaches it)."""
        from torch.autograd import Variable

        def done(index: int) -> Callable[[torch.Tensor], None]:
            def on_grad(_param: torch.Tensor) -> None:
                if self._last and self._buckets is not None and self._leaf is not None:  # its bucket may start now
                    self._buckets.ready(index, lambda i: self._leaf_grads(i, current=True))
                if not self._queued:
                    self._queued = True
                    Variable._execution_engine.queue_callback(self._end_of_backward)
            return on_grad

        def set_aside(param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            def before_accumulating(grad: torch.Tensor) -> torch.Tensor:
                self._reached.add(id(param))
                if param.grad is not None:  # a gradient from before this run (accumulation): kept whole, added back
                    self._carry[id(param)] = param.grad
                    param.grad = None
                return grad
            return before_accumulating

        for param in model.parameters():
            if param.requires_grad and all(param is not p for p in self._params):
                self._params.append(param)
                param.register_hook(set_aside(param))
                param.register_post_accumulate_grad_hook(done(len(self._params) - 1))  # its index: no search per call

    @property
    def micro_batch_size(self) -> int:
        """The examples of one micro-batch (given, or chosen from the first global batch)."""
        if self._micro_batch_size is None:
            raise FailedPreconditionError("bitwise=True chooses its micro-batch size from the first global batch of "
                                          "strategy.distribute_dataset; iterate its batches through strategy.run.")
        return self._micro_batch_size

    def check_batch_size(self, global_batch_size: int) -> None:
        """Refuse a global batch the micro-batch size does not divide, before the first step; without a size given,
        choose one from this batch: a twelfth (equal shares at 1, 2, 3, 4, 6 and 12 replicas), else the largest
        share of 8, 6, 4, 3 or 2 that divides it, else one example.

        Raises:
            ValueError: naming the sizes and micro-batch sizes that fit.
        """
        if self._micro_batch_size is None:
            leaves = next((n for n in (12, 8, 6, 4, 3, 2) if global_batch_size % n == 0), global_batch_size)
            self._micro_batch_size = global_batch_size // leaves
            log.info("bitwise=True: micro_batch_size=%d (the global batch of %d in %d micro-batches; pass "
                     "micro_batch_size= to choose)", self._micro_batch_size, global_batch_size, leaves)
        m = self._micro_batch_size
        if global_batch_size % m:
            fits = [d for d in range(1, m + 1) if global_batch_size % d == 0][-1]
            raise user_error(
                "bitwise=True cuts each global batch into micro-batches of micro_batch_size examples, the same at every "
                "replica count: the micro-batch size must divide the global batch",
                f"global_batch_size={global_batch_size}, micro_batch_size={m}",
                f"Use a global batch that is a multiple of {m}, or micro_batch_size={fits}; with "
                f"{self._num_replicas} replica(s) a multiple of {m * self._num_replicas} gives equal shares.")

    def leaf_ranges(self, batch_size: int) -> list[tuple[int, int]]:
        """Every replica's micro-batches ``[first, end)`` of a global batch of ``batch_size`` examples: the batch cut
        into micro-batches (the last may be short), shared out as ``towers.data.shard_bounds`` shares whole runs."""
        from towers.data import shard_bounds

        leaves = -(-batch_size // self.micro_batch_size)
        return [shard_bounds(leaves, self._num_replicas, r) for r in range(self._num_replicas)]

    # --- a step -----------------------------------------------------------------------------------------
    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any], local_batch_size: int) -> list[tuple[Any, Any]]:
        """``(args, kwargs)`` of each micro-batch: every tensor whose first dimension is the share cut into chunks (the
        last one short where the share ends the batch)."""
        flat, spec = tree_flatten((args, kwargs))
        m, count = self.micro_batch_size, -(-local_batch_size // self.micro_batch_size)
        cut = [list(v.split(m)) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == local_batch_size
               else [v] * count for v in flat]
        return [tree_unflatten([parts[i] for parts in cut], spec) for i in range(count)]

    def begin(self, ranges: list[tuple[int, int]]) -> None:
        """A global batch starts, cut into micro-batches: replica ``r`` computes leaves ``ranges[r]``."""
        self._leaves, self._losses, self._results = {}, [], []
        self._ranges, self._num_leaves = ranges, ranges[-1][1]
        self._leaf, self._last = ranges[self._rank][0], False

    def micro_batch(self, index: int | None, last: bool) -> None:
        """The micro-batch of global leaf ``index`` runs next (``last``: the batch's last one here); None: this
        replica's share is empty (or one padding example), its step runs once and its gradient is no leaf."""
        self._leaf, self._last = index, last
        if last and self._params and self._exchange_rows is None and self._deliver is None and self._num_replicas > 1:
            if self._buckets is None or self._buckets.num_params != len(self._params):
                self._buckets = BucketedExchange(self._params, self._num_replicas, self._group)
            self._buckets.begin(self._ranges, self._rank)  # the exchange starts bucket by bucket in its backward

    def note_result(self, result: Any) -> None:
        """Keep a micro-batch's result for the step's: its loss (a scalar tensor), per-example tensors (batch first,
        e.g. ``Trainer.fit``'s losses and predictions), a tuple of those, or None."""
        if not _combinable(result):
            raise user_error("Under bitwise=True the step function strategy.run calls runs once per micro-batch and "
                             "returns its loss (a scalar tensor), per-example tensors (batch first), a tuple of those, "
                             "or nothing", f"a {type(result).__name__}",
                             "Return compute_average_loss(...) from the step (or None), and compute metrics outside.")
        self._results.append(result)
        if isinstance(result, torch.Tensor) and result.dim() == 0 and self._leaf is not None:
            self._losses.append((self._leaf, result.detach()))

    def result(self) -> Any:
        """The step's result over this replica's micro-batches: a scalar loss summed over the tree (``reduce("sum",
        ...)`` sums it over the whole tree), per-example tensors concatenated in order, element by element in a tuple."""
        results, self._results = self._results, []
        self.last_result = None
        if not results or all(r is None for r in results):
            return None
        if isinstance(results[0], tuple):
            return tuple(_joined([r[i] for r in results]) for i in range(len(results[0])))
        if isinstance(results[0], torch.Tensor) and results[0].dim() == 0:
            known = {(0, i): v.reshape(()) for i, v in self._losses}
            zeros = results[0].detach().new_zeros
            nodes = [tree_sum(known, lv, ix, self._num_leaves, lambda: zeros(())) for lv, ix in self._own_nodes()]
            total = nodes[0] if nodes else zeros(())  # an empty share adds nothing
            for node in nodes[1:]:  # the share's own value (what a plain loop returns); reduce uses the tree
                total = total + node
            self.last_result = total
            return total
        return _joined(results)

    def reduce_sum(self) -> torch.Tensor:
        """The global batch's loss: every replica's micro-batch losses summed over the tree, the same bits everywhere."""
        first, end = self._ranges[self._rank]
        if len(self._losses) != end - first:
            raise user_error("Under bitwise=True the step returns a loss from every micro-batch or from none",
                             f"{len(self._losses)} of {end - first}", "Return compute_average_loss(...) from the step.")
        like = self.last_result if self.last_result is not None else torch.zeros(())
        mine = torch.stack([v for _, v in self._losses]) if self._losses else like.new_zeros(0)
        leaves = self._gather(mine) if self._num_replicas > 1 else mine  # replica order: leaf order
        known = {(0, i): v for i, v in enumerate(leaves.unbind())}
        return root_sum(known, self._num_leaves, lambda: mine.new_zeros(()))

    @property
    def leaf(self) -> int | None:
        """The global index of the micro-batch in progress (None: a step that computes no leaf)."""
        return self._leaf

    @property
    def last(self) -> bool:
        """Whether the micro-batch in progress is this replica's last of the batch (the tree is summed after it)."""
        return self._last

    def subtrees(self, leaves: dict[int, Node], zeros: Callable[[], Node]) -> list[Node]:
        """This replica's subtree values (the largest nodes within its share, in order) from its ``leaves``."""
        local = {(0, i): g for i, g in leaves.items()}
        return [tree_sum(local, lv, ix, self._num_leaves, zeros) for lv, ix in self._own_nodes()]

    def root(self, rows: list[list[Node]], zeros: Callable[[], Node]) -> Node:
        """The tree's sum from every replica's subtree values (``rows[r]``: replica ``r``'s, in order; extra entries
        of a padded row are ignored)."""
        known: dict[tuple[int, int], Node] = {}
        for r, row in enumerate(rows):
            known.update(zip(self._own_nodes(r), row))
        return root_sum(known, self._num_leaves, zeros)

    def reduce(self, op: str, value: Any) -> torch.Tensor | None:
        """``strategy.reduce(op, value)`` of the step's result: its losses summed over the tree when ``value`` is what
        ``run`` returned last and ``op`` is ``"sum"``; None for anything else (the strategy's own reduce then)."""
        if op == "sum" and value is not None and value is self.last_result:
            return self.reduce_sum()
        return None

    def width(self) -> int:
        """The subtrees the replica with the most holds (each replica sends that many, padded: one all-gather)."""
        return max(len(self._own_nodes(r)) for r in range(self._num_replicas))

    def _own_nodes(self, rank: int | None = None) -> list[tuple[int, int]]:
        return dyadic_nodes(*self._ranges[self._rank if rank is None else rank])

    # --- gradients --------------------------------------------------------------------------------------
    def _end_of_backward(self) -> None:
        self._queued = False
        if self._leaf is None:  # an empty share's step: its gradient is no leaf; it still joins the tree's exchange
            self._clear()
            if self._last:
                self._finish()
            return
        if self._leaf in self._leaves:
            raise user_error("Under bitwise=True each micro-batch's gradient is one backward's", "a second backward "
                             f"in the micro-batch of leaf {self._leaf}", "Call loss.backward() once per step "
                             "(sum the losses first), or leave bitwise off for a loop with several backwards.")
        # The gradients themselves are the leaf (no copy): .grad is emptied, so the next backward writes new ones.
        self._leaves[self._leaf] = Grads([p.grad if p.grad is not None and id(p) in self._reached
                                           else torch.zeros_like(p) for p in self._params])
        self._clear()
        if self._last:
            self._finish()

    def _clear(self) -> None:
        """Empty every ``.grad`` for the next micro-batch; one this backward did not reach is from before the run."""
        for p in self._params:
            if p.grad is not None and id(p) not in self._reached:
                self._carry.setdefault(id(p), p.grad)
            p.grad = None
        self._reached.clear()

    def _leaf_grads(self, i: int, current: bool = False) -> dict[tuple[int, int], torch.Tensor]:
        """Parameter ``i``'s gradient of each leaf of this share, by tree node (``current``: the micro-batch whose
        backward runs now included, from ``.grad``)."""
        known = {(0, leaf): grads.tensors[i] for leaf, grads in self._leaves.items()}
        grad = self._params[i].grad
        if current and self._leaf is not None and grad is not None:
            known[(0, self._leaf)] = grad
        return known

    def _finish(self) -> None:
        """Write the update's gradient, summed over the tree, into every parameter's ``.grad``."""
        if self._exchange_rows is None and self._deliver is None and self._num_replicas > 1:
            assert self._buckets is not None  # made as the last micro-batch began
            total = self._buckets.finish(self._leaf_grads)  # the buckets not started during the backward start now
            self._leaves = {}
        else:
            values = self.subtrees(self._leaves, lambda: Grads([torch.zeros_like(p) for p in self._params]))
            self._leaves = {}
            if self._deliver is not None:
                return self._hand_over(values, self._deliver)
            if self._num_replicas == 1:
                total = self.root([values], lambda: Grads([torch.zeros_like(p) for p in self._params])).tensors
            else:
                assert self._exchange_rows is not None  # (the replicas' own exchange: fault tolerance)
                flat, total, offset = self._exchange_whole(values, self._exchange_rows), [], 0
                for p in self._params:
                    total.append(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        for p, grad in zip(self._params, total):
            carry = self._carry.pop(id(p), None)  # earlier runs of an accumulated update: their trees, in run order
            p.grad = grad if carry is None else carry + grad

    def _hand_over(self, values: list[Grads], deliver: Callable[[list[Grads], list[tuple[int, int]], int], None]) -> None:
        """Give this replica's subtree values to ``deliver``; ``.grad`` becomes the share's sum (what a plain worker
        holds). A gradient from before the run cannot join a tree summed elsewhere: refused, not lost."""
        carried, self._carry = list(self._carry.values()), {}
        if any(bool(c.any()) for c in carried):  # zeros (zero_grad(set_to_none=False)) add nothing: let through
            raise user_error("Under bitwise=True with parameter servers each optimizer.step() sends one run's "
                             "micro-batches, and the ps sums them over the tree: a gradient left in .grad before the "
                             "run (accumulation by hand, or no zero_grad) cannot be added there in one device's order",
                             "a gradient in .grad when the step's backward began",
                             "Call optimizer.zero_grad() at the start of every step and step after every run (for "
                             "larger updates raise the global batch size).")
        share: Grads | None = values[0] if values else None
        for value in values[1:]:
            share = value if share is None else share + value
        for i, p in enumerate(self._params):
            p.grad = None if share is None else share.tensors[i]
        deliver(values, self._own_nodes(), self._num_leaves)

    def _exchange_whole(self, values: list[Grads], exchange: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The tree's sum, flat, from every replica's subtrees stacked whole by ``exchange``."""
        n, width, block = self._num_replicas, self.width(), self._block(values)
        rows, zeros = exchange(block), self._params[0].new_zeros
        return self.root([list(rows[r * width:(r + 1) * width].unbind()) for r in range(n)],
                         lambda: zeros(block.shape[1]))

    def _block(self, values: list[Grads]) -> torch.Tensor:
        """This replica's subtrees, one flat row each, padded with zero rows to ``width()``: one copy."""
        size, pad = sum(p.numel() for p in self._params), self.width() - len(values)
        flat = [t.reshape(-1) for v in values for t in v.tensors] + [self._params[0].new_zeros(size)] * pad
        return torch.cat(flat).view(-1, size)


def _combinable(result: Any) -> bool:
    if result is None or isinstance(result, torch.Tensor):
        return True
    return isinstance(result, tuple) and all(r is None or isinstance(r, torch.Tensor) and r.dim() > 0 for r in result)


def _joined(parts: list[Any]) -> Any:
    """The micro-batches' per-example tensors in order (None where the step returned none)."""
    tensors = [p for p in parts if p is not None]
    if not tensors:
        return None
    return torch.cat(tensors)
