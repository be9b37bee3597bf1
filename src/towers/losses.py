"""Loss scaling for synchronous replicas: ``compute_average_loss`` and ``scale_regularization_loss``.

Each replica divides the sum of its per-example losses by the step's GLOBAL batch size, and the
strategy SUMS gradients across replicas: the result is exactly the gradient of the mean loss
over the global batch, whatever the split (ragged last batch, empty shares included).
"""

from __future__ import annotations

import torch

from towers.strategies.base import current_replica_context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(per_example_loss: torch.Tensor, global_batch_size: int | None = None, *,
                         sample_weight: torch.Tensor | float | None = None) -> torch.Tensor:
    """Return ``sum(per_example_loss * sample_weight) / global_batch_size`` for this replica.

    ``global_batch_size`` defaults to what the strategy knows inside ``strategy.run``: the
    number of examples (over all replicas) in this optimizer update, i.e. the global batch
    of ``distribute_dataset`` (times the micro-batches of an update under gradient
    accumulation). Inside a run without that knowledge it is ``local batch * replicas *
    accumulation steps``; outside any strategy it is the local batch size. Padding examples
    (``pad_empty_batches``) weigh zero.

    Raises:
        ValueError: when ``per_example_loss`` is a scalar or ``global_batch_size`` is not positive.
    """
    if not isinstance(per_example_loss, torch.Tensor) or per_example_loss.dim() == 0:
        shape = tuple(per_example_loss.shape) if isinstance(per_example_loss, torch.Tensor) else type(per_example_loss).__name__
        raise ValueError(
            f"compute_average_loss expects one loss per example (shape [batch, ...]). Received: {shape}. "
            "Compute the loss with reduction='none', e.g. F.cross_entropy(logits, y, reduction='none').")
    ctx = current_replica_context()
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
    padding = ctx.num_padding_examples if ctx is not None else 0
    if padding:
        per_example_loss = per_example_loss[: per_example_loss.shape[0] - padding]
    if global_batch_size is None:
        if ctx is None:
            global_batch_size = per_example_loss.shape[0]
        elif ctx.global_batch_size is not None:
            global_batch_size = ctx.global_batch_size
        else:
            global_batch_size = per_example_loss.shape[0] * ctx.num_replicas_in_sync * ctx.accumulation_steps
        global_batch_size = max(int(global_batch_size), 1)  # an empty local batch outside a strategy: loss 0
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(
            f"global_batch_size must be a positive integer. Received: {global_batch_size!r}. "
            "Pass the number of examples in the step over all replicas, or leave it out inside strategy.run.")
    return per_example_loss.sum() / global_batch_size


def scale_regularization_loss(regularization_loss: torch.Tensor | float) -> torch.Tensor | float:
    """Return ``regularization_loss`` divided by the replicas (and micro-batches) whose gradients are summed.

    Added on every replica, the sum over replicas is the regularization term counted once per update.
    """
    ctx = current_replica_context()
    if ctx is None:
        return regularization_loss
    return regularization_loss / (ctx.num_replicas_in_sync * ctx.accumulation_steps)
