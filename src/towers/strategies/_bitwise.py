"""``bitwise=True``: one device's maths bit for bit, at any replica count.

Float addition is not associative, so a gradient summed in another order has other bits: N replicas
that each sum their share and then all-reduce the shares train what one device trains only within
rounding. Here the order is fixed by the global batch alone:

- the global batch of ``B`` examples is cut into ``L = B / micro_batch_size`` micro-batches (the
  leaves), numbered over the whole batch; replica ``r`` of ``N`` computes its contiguous ``L / N``
  of them, one forward and backward each, so every kernel sees the same shapes at every ``N``;
- the update's gradient is the sum over a fixed binary tree of the leaves (``node(l, i) =
  node(l-1, 2i) + node(l-1, 2i+1)``, leaves at level 0, zeros past ``L`` up to a power of two);
  each replica computes the largest subtrees that lie within its leaves, every replica receives
  every replica's subtrees (one all-gather), and each computes the nodes above them by the same
  formula: the same bits on every replica, and the same as one process, which walks the same tree;
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

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from towers.errors import FailedPreconditionError, user_error

__all__ = ["BitwiseSteps", "dyadic_nodes", "tree_sum", "keyed_random", "deterministic_kernels", "named_kernel_error"]


@contextlib.contextmanager
def keyed_random(device: torch.device, key: tuple[int, int, int]) -> Iterator[None]:
    """Within: torch's random generators seeded from ``key`` (epoch, global batch, global micro-batch), so a dropout
    mask is the micro-batch's, whichever replica computes it; the caller's random state is restored after."""
    epoch, batch, leaf = key
    seed = ((epoch * 1_000_003 + batch) * 1_000_003 + leaf) % (2 ** 63)
    devices = [device.index if device.index is not None else 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def deterministic_kernels(device: torch.device) -> None:
    """Turn on torch's deterministic kernels for the process (``bitwise=True`` asks for the same bits every run): an op
    without one then raises at its first call (``named_kernel_error`` names it); on a GPU cuBLAS gets the fixed
    workspace it needs for that (``CUBLAS_WORKSPACE_CONFIG``, unless set already)."""
    import os

    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def named_kernel_error(exc: RuntimeError) -> Exception | None:
    """The error to raise for torch's "no deterministic implementation" ``exc`` (None for another error)."""
    text = str(exc)
    if "does not have a deterministic implementation" not in text:
        return None
    op = text.split(" does not have a deterministic implementation")[0].strip()
    return user_error("bitwise=True runs with torch.use_deterministic_algorithms(True), and an op of the step has no "
                      "deterministic kernel on this device", op,
                      "Replace that op with one that has (e.g. index_add_ / scatter_add_ for a histogram, a dense "
                      "update for a sparse one), compute it on the CPU, or turn bitwise off (same maths within "
                      "rounding).")


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


def tree_sum(known: dict[tuple[int, int], torch.Tensor], level: int, index: int, num_leaves: int,
             zeros: Callable[[], torch.Tensor]) -> torch.Tensor:
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


class BitwiseSteps:
    """The micro-batches of this replica's share and the tree their gradients are summed over (held by a synchronous
    strategy built with ``bitwise=True``)."""

    def __init__(self, micro_batch_size: int, *, rank: int, num_replicas: int,
                 gather: Callable[[torch.Tensor], torch.Tensor]):
        self.micro_batch_size = micro_batch_size
        #: ``gather(t)``: every replica's ``t`` concatenated on dim 0, in replica order (the strategy's ``gather``)
        self._rank, self._num_replicas, self._gather = rank, num_replicas, gather
        self._params: list[nn.Parameter] = []
        self._leaves: dict[int, torch.Tensor] = {}  # this update's leaves computed here: global index -> flat gradient
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
    def watch(self, model: nn.Module) -> None:
        """Collect ``model``'s gradients per micro-batch (a hook at the end of every backward that reaches it)."""
        from torch.autograd import Variable

        def on_grad(_param: torch.Tensor) -> None:
            if not self._queued:
                self._queued = True
                Variable._execution_engine.queue_callback(self._end_of_backward)

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
                param.register_post_accumulate_grad_hook(on_grad)

    def check_batch_size(self, global_batch_size: int) -> None:
        """Refuse a global batch the micro-batch size does not divide, before the first step.

        Raises:
            ValueError: naming the sizes and micro-batch sizes that fit.
        """
        m = self.micro_batch_size
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
        return tree_sum(known, _levels(self._num_leaves), 0, self._num_leaves, lambda: mine.new_zeros(()))

    @property
    def leaf(self) -> int | None:
        """The global index of the micro-batch in progress (None: a step that computes no leaf)."""
        return self._leaf

    @property
    def last(self) -> bool:
        """Whether the micro-batch in progress is this replica's last of the batch (the tree is summed after it)."""
        return self._last

    def subtrees(self, leaves: dict[int, torch.Tensor], zeros: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
        """This replica's subtree values (the largest nodes within its share, in order) from its ``leaves``."""
        local = {(0, i): g for i, g in leaves.items()}
        return [tree_sum(local, lv, ix, self._num_leaves, zeros) for lv, ix in self._own_nodes()]

    def root(self, rows: list[list[torch.Tensor]], zeros: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tree's sum from every replica's subtree values (``rows[r]``: replica ``r``'s, in order; extra entries
        of a padded row are ignored)."""
        known: dict[tuple[int, int], torch.Tensor] = {}
        for r, row in enumerate(rows):
            known.update(zip(self._own_nodes(r), row))
        return tree_sum(known, _levels(self._num_leaves), 0, self._num_leaves, zeros)

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
        self._leaves[self._leaf] = self._flat()
        self._clear()
        if self._last:
            self._finish()

    def _flat(self) -> torch.Tensor:
        """This backward's gradient, flat: zeros for a parameter it did not reach."""
        return torch.cat([(p.grad if p.grad is not None and id(p) in self._reached else torch.zeros_like(p)).reshape(-1)
                          for p in self._params])

    def _clear(self) -> None:
        """Empty every ``.grad`` for the next micro-batch; one this backward did not reach is from before the run."""
        for p in self._params:
            if p.grad is not None and id(p) not in self._reached:
                self._carry.setdefault(id(p), p.grad)
            p.grad = None
        self._reached.clear()

    def _finish(self) -> None:
        """Write the update's gradient, summed over the tree, into every parameter's ``.grad``."""
        size = sum(p.numel() for p in self._params)
        zeros = self._params[0].new_zeros
        values = self.subtrees(self._leaves, lambda: zeros(size))
        rows = [values]
        if self._num_replicas > 1:  # every replica's subtrees: each knows which nodes another holds, padded to a count
            width = self.width()
            gathered = self._gather(torch.stack(values + [zeros(size)] * (width - len(values))))
            rows = [list(gathered[r * width:(r + 1) * width].unbind()) for r in range(self._num_replicas)]
        total = self.root(rows, lambda: zeros(size))
        offset = 0
        for p in self._params:
            n = p.numel()
            grad = total[offset:offset + n].view_as(p)
            carry = self._carry.pop(id(p), None)  # earlier runs of an accumulated update: their trees, in run order
            p.grad = grad.clone() if carry is None else carry + grad
            offset += n
        self._leaves = {}


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


def bitwise_steps(bitwise: Any, micro_batch_size: Any, *, strategy: str, precision: str,
                  refused: str | None = None) -> Callable[..., BitwiseSteps] | None:
    """Check ``bitwise=`` and ``micro_batch_size=`` before any process group; return how to build the ``BitwiseSteps``
    once the replicas are known (``build(rank, num_replicas, gather)``), or None when bitwise is off.

    Raises:
        ValueError: a micro-batch size that is not a positive integer, or an option bitwise cannot keep exact
            (``refused``: the strategy's own reason, e.g. a tensor-parallel mesh).
    """
    from towers.cluster.strategy_options import parse_flag

    if not parse_flag("bitwise", bitwise):
        return None
    if isinstance(micro_batch_size, str) and micro_batch_size.strip().isdigit():
        micro_batch_size = int(micro_batch_size)
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise user_error("bitwise=True needs micro_batch_size: the examples of one micro-batch, the unit whose "
                         "gradient is the same at every replica count", f"micro_batch_size={micro_batch_size!r}",
                         "Pass micro_batch_size=m (--strategy-option micro_batch_size=m) with m dividing the global "
                         "batch into equal shares at every replica count you will run, e.g. B/12 for 1, 2, 3 and 4.")
    for bad, why in ((refused, refused), (precision != "32", f"precision={precision!r}: autocast kernels")):
        if bad:
            raise user_error(f"{strategy}(bitwise=True) cannot keep this exact", str(why),
                             "Leave it out with bitwise=True (precision='32'), or turn bitwise off.")
    size = micro_batch_size

    def build(rank: int, num_replicas: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> BitwiseSteps:
        return BitwiseSteps(size, rank=rank, num_replicas=num_replicas, gather=gather)

    return build


def refuse_bitwise(strategy: str, bitwise: Any) -> None:
    """Refuse ``bitwise=True`` on a strategy that does not build it yet, before any process group.

    Raises:
        ValueError: naming the strategy and the ones that take it.
    """
    from towers.cluster.strategy_options import parse_flag

    if parse_flag("bitwise", bitwise):
        raise user_error(f"{strategy} does not train bit for bit yet", "bitwise=True",
                         "Use OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy or FullyShardedStrategy "
                         "with bitwise=True (--strategy mirrored --bitwise), or leave bitwise off here.")
