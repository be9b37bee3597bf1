"""Losses normalised by the update's global weight: ``compute_average_loss(loss, weights=...)``.

A token-level loss (padding tokens weigh 0) is one device's mean only when it is divided by the
number of tokens in the whole update: every replica's and every accumulated micro-batch's. That
number is known only when the update's last micro-batch has run. So each replica backpropagates
the weighted SUM of its losses, notes its weight here, and as the update step's backward ends
(after the strategy's own gradient all-reduce or reduce-scatter) the gradient is divided by the
weights' sum over all replicas: one small all-reduce per update. From then on ``p.grad`` is exactly
one device's: torch's own ``clip_grad_norm_``, gradient logging and the optimizer all see it.

Losses that no towers normaliser produced (a model's mean ``out.loss``, Accelerate's habit) are
refused at the update step where replicas sum their gradients: summed means are N times one
device's gradient, so the first such step stops with the fix instead of training on it.

Every strategy holds one ``UpdateWeights`` (``strategy._loss_weights``); the hooks ``towers.losses``
calls (``note_weighted_loss``, ``note_example_normalised_loss``) and the ones a strategy overrides
(``_check_weighted_loss``, ``_finish_loss_weights``, ``_sums_replica_gradients``) are ``Strategy``'s
methods (``base.py``), built from the helpers here.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from towers.errors import user_error

__all__ = ["UpdateWeights", "note_normalised", "prepared_parameters", "no_optimizer_to_divide", "after_backward",
           "queue_after_backward"]

# Losses towers normalised in this process (compute_average_loss, scale_regularization_loss), inside strategy.run
# or not: an update with none since the last one backpropagated something else (a per-replica mean).
_normalised = [0]


def note_normalised() -> None:
    """Count one loss that a towers normaliser produced (the update that backpropagates it is one device's)."""
    _normalised[0] += 1

_MIXED = ("compute_average_loss(..., weights=...) cannot share an update with a loss normalised otherwise "
          "(compute_average_loss without weights, or scale_regularization_loss)")
_UNNORMALISED = ("The loss backpropagated in this update did not come from towers.compute_average_loss, and {n} replicas "
                 "SUM their gradients: a per-replica mean loss (e.g. a Hugging Face model's out.loss, or "
                 "F.cross_entropy(logits, y)) would train on {n} times one device's gradient")
_UNNORMALISED_FIX = ("Compute per-example losses (reduction='none') and backpropagate "
                     "towers.compute_average_loss(per_example) (divides by the GLOBAL batch), or "
                     "compute_average_loss(per_token, weights=(labels != -100).float()) for a token loss; a loss you "
                     "already divided by the global batch yourself: compute_average_loss(per_example, "
                     "global_batch_size=N). Or train with towers.Trainer, which normalises a model's own loss itself.")
_TWICE = ("This update's gradient was already divided by its global loss weight when its backward ended, and another "
          "weighted loss (compute_average_loss(..., weights=...)) was computed for the same update")
_TWICE_FIX = ("Backpropagate an update's weighted losses in one backward (sum them first: "
              "strategy.backward(loss_a + loss_b)), or step the optimizer before the next one.")
_MIXED_FIX = ("Normalise every term of the update the same way: give each its weights (e.g. an auxiliary term "
              "as compute_average_loss(aux.expand(n), weights=...)), or drop weights= and divide by a count you know.")


class UpdateWeights:
    """The loss weights of the update in progress on this replica, and how its losses were normalised."""

    def __init__(self) -> None:
        self.weight = 0.0  # this replica's weight in the update so far
        self.weighted = False  # a weighted loss was noted in this update
        self.plain = False  # a loss normalised by examples was noted in this update
        self.closed = False  # the last note was on an update's last micro-batch
        self.divided = False  # the update's gradient was divided by its global weight as its backward ended
        # towers-normalised losses counted at the last update's step (made lazily: count from the process's start)
        self._normalised_seen = 0

    def _begin(self, last_micro_batch: bool) -> None:
        # Notes after an update's last micro-batch that no step finished (an evaluation pass with gradients on,
        # or a step never taken) belong to no update: a new one starts.
        if self.closed:
            self.weight, self.weighted, self.plain = 0.0, False, False
        self.closed = last_micro_batch

    def note_weighted(self, weight: float, last_micro_batch: bool) -> None:
        """Note one micro-batch's weighted loss of ``weight`` (its gradient waits for the update's total)."""
        if self.divided:
            raise user_error(_TWICE, f"a weighted loss of weight {weight:g} after the division", _TWICE_FIX)
        self._begin(last_micro_batch)
        if self.plain:
            raise user_error(_MIXED, "a weighted loss after an example-normalised one in the same update", _MIXED_FIX)
        self.weighted = True
        self.weight += weight

    def note_plain(self, last_micro_batch: bool) -> None:
        """Note a loss normalised by the global batch size (refused inside a weighted update)."""
        self._begin(last_micro_batch)
        if self.weighted:
            raise user_error(_MIXED, "an example-normalised loss after a weighted one in the same update", _MIXED_FIX)
        self.plain = True

    def finish(self, parameters: Iterable[torch.Tensor], reduce_sum: Callable[[torch.Tensor], torch.Tensor], *,
               when: str = "step", replicas_summed: int = 1) -> None:
        """At the update step: divide the gradients by the update's global weight (when weighted).

        ``reduce_sum`` is the strategy's sum over replicas (a collective: every replica calls
        ``finish`` at the same update step). ``when``: ``"backward"`` as the update step's backward ends,
        ``"clip"`` in ``clip_grad_norm_``, ``"step"`` as the optimizer steps (the update ends there: a
        new one starts). ``replicas_summed`` (> 1 where replicas sum their gradients): a step whose
        gradients no towers normaliser produced is refused.

        Raises:
            ValueError: an update of several summed replicas whose loss no towers normaliser produced.
        """
        params: list[torch.Tensor] | None = None  # listed only where needed: most steps need none (every step's path)
        if when == "step":
            normalised = _normalised[0] != self._normalised_seen  # every weighted or plain note counted there too
            self._normalised_seen = _normalised[0]
            if replicas_summed > 1 and not normalised:
                params = list(parameters)
                if any(p.grad is not None for p in params):
                    raise user_error(_UNNORMALISED.format(n=replicas_summed), "a loss normalised by none of them",
                                     _UNNORMALISED_FIX)
        weighted, weight = self.weighted, self.weight
        self.weight, self.weighted, self.plain, self.closed = 0.0, False, False, False
        # Divided as backward ended: further weighted losses of this update are refused until the optimizer steps.
        self.divided = (self.divided or (when == "backward" and weighted)) and when != "step"
        if not weighted:
            return
        total = float(reduce_sum(torch.tensor([weight], dtype=torch.float64)).reshape(-1)[0].item())
        if total <= 0:  # no weight anywhere: every gradient is zero already
            return
        for p in params if params is not None else parameters:
            if p.grad is not None:
                p.grad.div_(total)


def prepared_parameters(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    """The parameters of ``optimizers``, lazily (``UpdateWeights.finish`` lists them only where it needs them)."""
    return (p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"])


def no_optimizer_to_divide(strategy_name: str) -> Exception:
    """The error for a weighted loss under a strategy that prepared no optimizer.

    The division happens in the prepared optimizer's ``step()`` (or ``clip_grad_norm_``): without a
    prepared optimizer the gradient would silently stay the weighted sum.
    """
    return user_error(
        "compute_average_loss(..., weights=...) divides the gradient by the update's global weight when the "
        "optimizer returned by strategy.prepare steps, and this strategy prepared no optimizer",
        f"{strategy_name} with no prepared optimizer",
        "Prepare the optimizer with the model: model, optimizer = strategy.prepare(model, optimizer), and call "
        "that optimizer's step().")


def queue_after_backward(finish: Callable[[], None]) -> None:
    """From inside a backward (a hook): run ``finish`` as it ends, after the callbacks DDP and FSDP queue during it.

    The engine runs its final callbacks in the order they were queued, and runs those queued while it does: a
    callback that queues ``finish`` once more puts it after every callback queued before it ran (DDP queues
    its gradient all-reduce's completion when its last bucket is ready, after a hook early in the backward).
    """
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.queue_callback(lambda: engine.queue_callback(finish))


def after_backward(loss: torch.Tensor, finish: Callable[[], None]) -> None:
    """Call ``finish`` as the backward through ``loss`` ends, after the strategy's own backward callbacks.

    A hook on ``loss`` runs at the start of its backward and queues ``finish`` with ``queue_after_backward``:
    it runs after the callbacks DDP and FSDP queue during the same backward (their gradient all-reduce /
    reduce-scatter), so ``p.grad`` is final when backward returns.
    """

    def at_backward_start(grad: torch.Tensor) -> torch.Tensor:
        queue_after_backward(finish)
        return grad

    loss.register_hook(at_backward_start)
