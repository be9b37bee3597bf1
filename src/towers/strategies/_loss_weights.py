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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from towers.errors import user_error

__all__ = ["UpdateWeights", "StrategyLossWeights", "note_normalised"]

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


class StrategyLossWeights:
    """The part of ``Strategy`` that normalises a loss by the update's global weight (a base class: its state is the
    strategy's). ``towers.losses`` calls its two public hooks; a strategy overrides ``_check_weighted_loss`` where it
    cannot normalise by weights, and ``_sums_replica_gradients`` where an update is not the replicas' sum."""

    if TYPE_CHECKING:
        @property
        def num_replicas_in_sync(self) -> int: ...
        def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor: ...
        def _prepared_optimizers(self) -> list[torch.optim.Optimizer]: ...

    @property
    def _loss_weights(self) -> UpdateWeights:
        """This replica's loss weights in the update in progress (``compute_average_loss(weights=...)``)."""
        return self.__dict__.setdefault("_update_weights", UpdateWeights())

    # --- the loss normalisers' hooks (towers.losses; not for user code) -------------------------------
    def note_example_normalised_loss(self, *, update_step: bool) -> None:
        """Note a loss normalised by examples in the update in progress (``update_step``: its last micro-batch).

        Called by ``towers.losses`` (``compute_average_loss`` without ``weights``, ``scale_regularization_loss``)
        where several replicas or micro-batches share an update.

        Raises:
            ValueError: the update already holds a loss normalised by weights.
        """
        self._loss_weights.note_plain(update_step)

    def note_weighted_loss(self, loss: torch.Tensor, weight: float, *, update_step: bool) -> None:
        """Note a loss normalised by ``weight`` (``compute_average_loss(..., weights=...)``) in the update in progress.

        ``loss`` is what the caller returns (its gradient is the weighted SUM); at the update step
        (``update_step``) the update's gradients are divided by its global weight as the backward
        through ``loss`` ends. Called by ``towers.losses``.

        Raises:
            NotImplementedError: this strategy cannot normalise by weights.
            ValueError: this strategy prepared no optimizer, or the update mixes weighted and example-normalised
                losses, or its gradient was divided already.
        """
        self._check_weighted_loss()
        self._loss_weights.note_weighted(weight, update_step)
        if update_step:
            self._finish_after_backward(loss)

    def _check_weighted_loss(self) -> None:
        """Raise when this strategy cannot normalise a loss by the update's global weight.

        The division happens in the prepared optimizer's ``step()`` (or ``clip_grad_norm_``): without a
        prepared optimizer the gradient would silently stay the weighted sum.
        """
        if not self._prepared_optimizers():
            raise user_error(
                "compute_average_loss(..., weights=...) divides the gradient by the update's global weight when the "
                "optimizer returned by strategy.prepare steps, and this strategy prepared no optimizer",
                f"{type(self).__name__} with no prepared optimizer",
                "Prepare the optimizer with the model: model, optimizer = strategy.prepare(model, optimizer), and call "
                "that optimizer's step().")

    def _finish_loss_weights(self, when: str = "step") -> None:
        """At an update step: divide the gradients by the update's global loss weight, when its losses were weighted.

        Called as the update step's backward ends (``"backward"``), and again in ``clip_grad_norm_`` (``"clip"``) and
        as the optimizer steps (``"step"``), which find nothing left to divide and refuse a loss no towers
        normaliser produced."""
        params = (p for optimizer in self._prepared_optimizers() for group in optimizer.param_groups
                  for p in group["params"])  # lazily: finish lists them only where it needs them
        self._loss_weights.finish(params, lambda total: self.reduce("sum", total), when=when,
                                  replicas_summed=self.num_replicas_in_sync if self._sums_replica_gradients else 1)

    @property
    def _sums_replica_gradients(self) -> bool:
        """True where an update is the SUM of the replicas' gradients (one device's only for normalised losses)."""
        return True

    def _finish_after_backward(self, loss: torch.Tensor) -> None:
        """Divide the update's gradients by its global weight as the backward through ``loss`` ends.

        A hook on ``loss`` queues a callback at the start of its backward; the callback queues the
        division once more, so that it runs after the callbacks DDP and FSDP queue during the same
        backward (their gradient all-reduce / reduce-scatter): ``p.grad`` is final when backward returns.
        """
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def after_the_strategys_callbacks() -> None:
            engine.queue_callback(lambda: self._finish_loss_weights("backward"))

        def at_backward_start(grad: torch.Tensor) -> torch.Tensor:
            engine.queue_callback(after_the_strategys_callbacks)
            return grad

        loss.register_hook(at_backward_start)
