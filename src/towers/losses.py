"""Loss scaling for synchronous replicas: ``compute_average_loss`` and ``scale_regularization_loss``.

Each replica divides the sum of its per-example losses by the step's GLOBAL batch size, and the
strategy SUMS gradients across replicas: the result is exactly the gradient of the mean loss
over the global batch, whatever the split (ragged last batch, empty shares included).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from towers.errors import InvalidArgumentError, user_error
from towers.strategies._loss_weights import note_normalised
from towers.strategies.base import ReplicaContext, current_replica_context, current_strategy

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(per_example_loss: torch.Tensor, global_batch_size: int | None = None, *,
                         sample_weight: torch.Tensor | float | None = None,
                         weights: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``sum(per_example_loss * sample_weight) / global_batch_size`` for this replica.

    Summed over the replicas (as their gradients are), this is the mean loss of the global batch: one
    device's maths at any replica count. Padding examples (``pad_empty_batches``) weigh zero. With one
    replica and no accumulation the local batch is the global batch, so any batch works there.

    Args:
        per_example_loss: the loss of each example of this replica's batch (``reduction="none"``), at
            least one dimension.
        global_batch_size: the number of examples (over all replicas) in this optimizer update. Default:
            what the batch given to ``strategy.run`` carries, i.e. the global batch of
            ``distribute_dataset`` (the sum of an update's micro-batches under gradient accumulation).
        sample_weight: a weight per example (or one for all), applied before the sum.
        weights: a tensor shaped like the loss (e.g. ``(labels != -100).float()`` for a token-level loss
            ``[batch, tokens]``) that normalises by the WEIGHTS instead: the gradient is exactly that of
            ``sum(loss * weights) / W`` where ``W`` is the sum of the weights over every replica and every
            accumulated micro-batch of the update (one device's token mean, whatever the padding and the
            split). ``W`` is known only at the update step, so there the strategy divides the gradient by
            it (one small all-reduce, before clipping and the optimizer step); the value returned is this
            share's weighted mean divided by the shares of the update (replicas x micro-batches), so summed
            over them it is the mean of the shares' means. Every loss term of such an update must then use
            ``weights``.

    Returns:
        A scalar tensor: this replica's share of the global batch's mean loss.

    Raises:
        ValueError: when ``per_example_loss`` is a scalar or ``global_batch_size`` is not positive; when
            the global batch size is unknown because several replicas (or micro-batches) share the step:
            outside ``strategy.run``, or inside it on a batch that did not come from ``distribute_dataset``;
            when ``weights`` does not fit the loss, is combined with ``global_batch_size`` or
            ``sample_weight``, or an update mixes weighted and example-normalised losses.

    Example:
        ```python
        import torch, torch.nn.functional as F
        import towers

        strategy = towers.OneDeviceStrategy("cpu")
        model, _ = strategy.prepare(torch.nn.Linear(4, 3))
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

        def step(x, y):
            per_example = F.cross_entropy(model(x), y, reduction="none")
            return towers.compute_average_loss(per_example, global_batch_size=8)

        loss = strategy.run(step, args=(x, y))  # the mean over the 8 examples
        ```
    """
    per_example_loss = _replicated_as_plain(per_example_loss)
    if weights is not None:
        return _weighted_loss(per_example_loss, weights, global_batch_size, sample_weight)
    if not isinstance(per_example_loss, torch.Tensor) or per_example_loss.dim() == 0:
        shape = tuple(per_example_loss.shape) if isinstance(per_example_loss, torch.Tensor) else type(per_example_loss).__name__
        raise InvalidArgumentError(
            f"compute_average_loss expects one loss per example (shape [batch, ...]). Received: {shape}. "
            "Compute the loss with reduction='none', e.g. F.cross_entropy(logits, y, reduction='none').")
    ctx = current_replica_context()
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
    padding = ctx.num_padding_examples if ctx is not None else 0
    if padding:
        per_example_loss = per_example_loss[: per_example_loss.shape[0] - padding]
    if global_batch_size is None:
        global_batch_size = _known_global_batch_size(ctx, per_example_loss.shape[0])
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise InvalidArgumentError(
            f"global_batch_size must be a positive integer. Received: {global_batch_size!r}. "
            "Pass the number of examples in the step over all replicas, or leave it out inside strategy.run.")
    if per_example_loss.requires_grad:
        note_normalised()
        if ctx is not None and (ctx.num_replicas_in_sync > 1 or ctx.accumulation_steps > 1):
            ctx.strategy.note_example_normalised_loss(update_step=ctx.is_update_step)
    return per_example_loss.sum() / global_batch_size


def _replicated_as_plain(loss: Any) -> Any:
    """A loss that torch's ``loss_parallel`` returned (a DTensor, the same on every tensor-parallel process) as the plain
    tensor it equals, so that weights, sample weights and padding combine with it; anything else as it is."""
    placements = getattr(loss, "placements", None)
    if placements is not None and all(p.is_replicate() for p in placements):
        return loss.to_local()  # its gradient flows back to the DTensor
    return loss


def _weighted_loss(loss: torch.Tensor, weights: torch.Tensor, global_batch_size: int | None,
                   sample_weight: torch.Tensor | float | None) -> torch.Tensor:
    """``compute_average_loss(loss, weights=...)``: normalised by the update's global sum of ``weights``."""
    if global_batch_size is not None or sample_weight is not None:
        raise user_error("compute_average_loss takes weights= alone: it normalises by the weights' global sum",
                         f"weights with {'global_batch_size' if global_batch_size is not None else 'sample_weight'}",
                         "Fold a per-example weight into weights (weights * sample_weight[:, None]) and leave "
                         "global_batch_size out.")
    if not isinstance(loss, torch.Tensor) or not isinstance(weights, torch.Tensor):
        raise user_error("compute_average_loss(loss, weights=...) expects two tensors",
                         f"{type(loss).__name__} and {type(weights).__name__}",
                         "Pass the unreduced loss (reduction='none') and a weight tensor of the same shape, e.g. "
                         "(labels != -100).float().")
    try:
        weights = torch.broadcast_to(weights, loss.shape) if loss.dim() else weights
    except RuntimeError:
        raise user_error("weights must have the loss's shape (or broadcast to it)",
                         f"loss {tuple(loss.shape)}, weights {tuple(weights.shape)}",
                         "Pass one weight per loss element, e.g. (labels != -100).float() for a loss "
                         "F.cross_entropy(logits.transpose(1, 2), labels, reduction='none').") from None
    if loss.dim() == 0 or weights.shape != loss.shape:
        raise user_error("weights must have the loss's shape, with the batch first",
                         f"loss {tuple(loss.shape)}, weights {tuple(weights.shape)}",
                         "Compute the loss with reduction='none' and pass one weight per element.")
    ctx = current_replica_context()
    padding = ctx.num_padding_examples if ctx is not None else 0
    if padding:  # padding examples weigh nothing
        loss, weights = loss[: loss.shape[0] - padding], weights[: weights.shape[0] - padding]
    # Exact counts (a bf16 sum is not past 256). Weights on the host are summed there: no wait for the device.
    weight = _checked_weight(weights)
    weights = weights.to(loss.device, non_blocking=True)
    weights = weights.to(loss.dtype) if loss.is_floating_point() else weights.float()
    total = (loss * weights).sum()
    shares = 1 if ctx is None else ctx.gradient_shares
    if shares == 1 and (ctx is not None or _replicas_outside_run() == 1):
        return total / weight if weight > 0 else total * 0.0  # one device, one micro-batch: divide now
    if ctx is None:
        raise user_error(
            "compute_average_loss(..., weights=...) was called outside strategy.run while several replicas train",
            f"{_replicas_outside_run()} replicas",
            "Call it inside the step function given to strategy.run: the gradient is divided by the weights' sum "
            "over the replicas at the update step.")
    shown = (total.detach() / weight if weight > 0 else total.detach() * 0.0) / shares
    # The gradient is the weighted SUM's (divided by the global weight as the update step's backward ends); the
    # value is the share's.
    result = total + (shown - total.detach())
    if total.requires_grad:  # a loss to train on (an evaluation under no_grad notes nothing)
        note_normalised()
        ctx.strategy.note_weighted_loss(result, weight, update_step=ctx.is_update_step)
    return result


def _checked_weight(weights: torch.Tensor) -> float:
    """Return the sum of ``weights`` (float64); raise when one is NaN, infinite or negative.

    The smallest weight is read with the sum, which is read anyway (on a device, in the same
    transfer); the bad ones are counted only when there are some.
    """
    weights = weights.detach()
    if weights.numel() == 0:
        return 0.0
    if weights.device.type == "cpu":
        total, lowest = float(weights.sum(dtype=torch.float64)), float(weights.min())
    else:
        total, lowest = torch.stack((weights.sum(dtype=torch.float64), weights.min().double())).tolist()
    if math.isfinite(total) and lowest >= 0:
        return total
    host = weights.to("cpu", torch.float64)
    bad = ~torch.isfinite(host) | (host < 0)
    count, first = int(bad.sum()), float(host[bad].reshape(-1)[0])
    raise user_error(
        "compute_average_loss(..., weights=...) takes finite weights >= 0 (each weighs one loss element in a mean)",
        f"{count} of {host.numel()} weight(s) NaN, infinite or negative (e.g. {first:g})",
        "Build the weights from a mask, e.g. (labels != -100).float(), or clean them first: "
        "weights.nan_to_num(0.0).clamp(min=0.0).")


def _known_global_batch_size(ctx: ReplicaContext | None, local_batch_size: int) -> int:
    """The step's global batch size when it can be known without the caller; raise the fix otherwise."""
    if ctx is not None and ctx.global_batch_size is not None:
        return int(ctx.global_batch_size)
    replicas = ctx.num_replicas_in_sync if ctx is not None else _replicas_outside_run()
    accumulation = ctx.accumulation_steps if ctx is not None else 1
    if replicas == 1 and accumulation == 1:
        return max(local_batch_size, 1)  # an empty batch on one device: loss 0
    if ctx is None:
        raise InvalidArgumentError(
            f"compute_average_loss was called outside strategy.run while {replicas} replicas train in sync, so it "
            f"cannot know the global batch size (this replica holds {local_batch_size} example(s) of it). Call it "
            "inside the step function given to strategy.run(step, args=(x, y)) with the batch from "
            "strategy.distribute_dataset, or pass global_batch_size=N explicitly.")
    what = f"{replicas} replicas" if replicas > 1 else f"{accumulation} accumulated micro-batches"
    raise InvalidArgumentError(
        f"compute_average_loss cannot know the global batch size: strategy.run was not given a batch from "
        f"strategy.distribute_dataset (this replica's batch has {local_batch_size} example(s); {what} share the "
        "step). Pass the batch exactly as distribute_dataset yielded it to strategy.run(step, args=(x, y)) and "
        "transform it inside the step, or pass global_batch_size=N (examples over all replicas and micro-batches "
        "of the update).")


def _replicas_outside_run() -> int:
    """Replicas training in sync when no ``strategy.run`` encloses the call: the enclosing scope's strategy, or the job."""
    strategy = current_strategy()
    if strategy is not None:
        return int(strategy.num_replicas_in_sync)
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def scale_regularization_loss(regularization_loss: torch.Tensor | float) -> torch.Tensor | float:
    """Return ``regularization_loss`` divided by the replicas (and micro-batches) whose gradients are summed.

    Added on every replica, the sum over replicas is the regularization term counted once per update.

    Args:
        regularization_loss: the term as one device would add it (e.g. ``1e-4 * sum of squared weights``).

    Returns:
        The term divided by the update's gradient shares inside ``strategy.run`` (``num_replicas_in_sync *
        accumulation_steps``; under ``bitwise=True`` its micro-batches); the term unchanged outside it.
    """
    if getattr(regularization_loss, "requires_grad", False):
        note_normalised()
    ctx = current_replica_context()
    if ctx is None:
        return regularization_loss
    if ctx.gradient_shares > 1 and getattr(regularization_loss, "requires_grad", False):
        ctx.strategy.note_example_normalised_loss(update_step=ctx.is_update_step)
    return regularization_loss / ctx.gradient_shares
