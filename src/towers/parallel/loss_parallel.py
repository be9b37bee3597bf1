"""Loss parallelism (``loss_parallel=True`` on a tp mesh): the vocabulary head's logits stay split over tp for the loss.

Without it, a tensor-parallel head (``"colwise_rep"``) gathers each process's slice of the
vocabulary into whole logits: batch x sequence x vocabulary floats on every tp process, kept for
backward with their gradient. With it, the head's output stays a DTensor sharded on the vocabulary
(``"colwise_loss_parallel"``), and ``strategy.forward_backward`` runs the user's loss and its backward
inside torch's ``loss_parallel()``, where ``F.cross_entropy`` computes on the slices (one all-reduce
of a max and of a sum per position instead of a gather of the logits). The user's loss code does not
change: ``compute_average_loss(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")...)``
gives the same numbers.

Everywhere else the logits are whole, as without it: a forward outside ``forward_backward`` (evaluation,
prediction, a model's own loss, a custom step that calls ``model(x)``) gathers the head's output, and
``forward_backward`` returns the loss as a plain tensor. Its ``outputs`` stay the sharded DTensor
(``.full_tensor()`` gathers them); ``Trainer.fit`` gathers them for its metrics.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from torch import nn

from towers._logging import get_logger
from towers.data._batch import whole
from towers.parallel.tensor_parallel import matched_modules

__all__ = ["LOSS_PARALLEL_STYLE", "loss_parallel_plan", "gather_heads_outside", "loss_parallel_scope"]

log = get_logger(__name__)

#: The style of a head whose logits stay split: ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``.
LOSS_PARALLEL_STYLE = "colwise_loss_parallel"


def loss_parallel_plan(plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` with each gathered head (``"colwise_rep"``) kept split for the loss instead."""
    return {name: LOSS_PARALLEL_STYLE if style == "colwise_rep" else style for name, style in plan.items()}


def gather_heads_outside(model: nn.Module, plan: Mapping[str, Any], sharded: Callable[[], bool]) -> list[str]:
    """Make each loss-parallel head of ``model`` return whole logits unless ``sharded()`` (inside ``forward_backward``);
    return the heads' names (none: the plan splits no head, loss parallelism has nothing to do)."""
    heads = [p for p, style in plan.items() if style == LOSS_PARALLEL_STYLE]

    def whole_unless_sharded(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        return output if sharded() else whole(output)

    found = [(name, module) for pattern in heads for name, module in matched_modules(model, pattern)]
    for _, module in found:
        module.register_forward_hook(whole_unless_sharded)
    return [name for name, _ in found]


@contextlib.contextmanager
def loss_parallel_scope(enabled: bool) -> Iterator[None]:
    """torch's ``loss_parallel()`` when ``enabled`` (the loss and its backward on logits split over the vocabulary)."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
