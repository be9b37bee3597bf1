"""``bitwise=True``'s step: the step function once per micro-batch of this replica's share (``_bitwise.py`` sums their
gradients over the tree), shared by the synchronous strategies and the fault-tolerant one."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from towers.data import BatchInfo
from towers.errors import user_error
from towers.strategies._bitwise import BitwiseSteps
from towers.strategies._bitwise_setup import keyed_random, named_kernel_error

__all__ = ["run_micro_batches"]


def run_micro_batches(bitwise: BitwiseSteps, batch: BatchInfo | None, fn: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any], *, replica_id: int, device: torch.device,
                      step_context: Callable[[bool, int | None, int], contextlib.AbstractContextManager[Any]]) -> Any:
    """Run ``fn`` once per micro-batch of replica ``replica_id``'s share of ``batch``; return the share's result
    (``BitwiseSteps.result``).

    An empty share (the last batch of an epoch, fewer micro-batches than replicas) runs ``fn`` once on what it was
    given (0 examples, or one padding example), so that its backward joins the tree's exchange. Under
    ``bitwise.lockstep`` every replica runs as many micro-batches as the one with the most (a forward with collectives
    of its own, FSDP2's), the extra ones repeating the first and counting nothing.

    Args:
        bitwise: the strategy's micro-batches and tree.
        batch: the accounting of the batch ``args`` came from (``distribute_dataset``'s).
        fn: the user's step function.
        args: its arguments (the share; every tensor whose first dimension is the share is cut).
        kwargs: its keyword arguments (cut the same way).
        replica_id: this replica's place in the step's split.
        device: where random draws are keyed.
        step_context: ``step_context(last, leaf, count)``: what to enter around one micro-batch (the strategy's
            replica context; ``last``: this replica's last of the batch, ``leaf``: its global index or None,
            ``count``: the micro-batches that train here).

    Returns:
        The step's result over this replica's micro-batches.

    Raises:
        ValueError: a batch that is not one of ``distribute_dataset``'s shares, or an op without a deterministic kernel.
    """
    ranges = bitwise.leaf_ranges(0 if batch is None else batch.global_batch_size)
    first, end = ranges[replica_id]
    m = bitwise.micro_batch_size
    if batch is None or batch.local_batch_size != max(0, min(end * m, batch.global_batch_size) - first * m):
        raise user_error("bitwise=True needs the batches of strategy.distribute_dataset, whose shares are whole "
                         "micro-batches", "a batch " + ("without accounting" if batch is None else
                         f"share of {batch.local_batch_size} example(s) of {batch.global_batch_size}"),
                         "Iterate strategy.distribute_dataset(...) of this strategy and pass its batches to run.")
    bitwise.begin(ranges)
    parts = bitwise.split(args, kwargs, batch.local_batch_size) if end > first else [(args, kwargs)]
    count = len(parts)  # the micro-batches that train; lockstep repeats the first (its gradient counts nothing)
    if bitwise.lockstep:
        parts += parts[:1] * (max(max(1, e - f) for f, e in ranges) - count)
    for i, (margs, mkwargs) in enumerate(parts):
        last = i == len(parts) - 1
        leaf = first + i if first + i < end else None
        bitwise.micro_batch(leaf, last)
        # Random draws (dropout) keyed by the micro-batch's place in the job, not by the replica computing it.
        with step_context(last, leaf, count), keyed_random(device, (batch.epoch, batch.index, -1 if leaf is None else leaf)):
            try:
                result = fn(*margs, **mkwargs)
            except RuntimeError as exc:
                raise (named_kernel_error(exc) or exc) from exc
        if i < count:
            bitwise.note_result(result)
    return bitwise.result()
