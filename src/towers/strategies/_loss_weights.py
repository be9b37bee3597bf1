"""Losses normalised by the update's global weight: ``compute_average_loss(loss, weights=...)``.

A token-level loss (padding tokens weigh 0) is one device's mean only when it is divided by the
number of tokens in the whole update: every replica's and every accumulated micro-batch's. That
number is known only when the update's last micro-batch has run. So each replica backpropagates
the weighted SUM of its losses, notes its weight here, and at the update step (before clipping or
the optimizer step) the gradient is divided by the weights' sum over all replicas: one small
all-reduce per update. The gradient is then exactly one device's.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from towers.errors import user_error

__all__ = ["UpdateWeights"]

_MIXED = ("compute_average_loss(..., weights=...) cannot share an update with a loss normalised otherwise "
          "(compute_average_loss without weights, or scale_regularization_loss)")
_MIXED_FIX = ("Normalise every term of the update the same way: give each its weights (e.g. an auxiliary term "
              "as compute_average_loss(aux.expand(n), weights=...)), or drop weights= and divide by a count you know.")


class UpdateWeights:
    """The loss weights of the update in progress on this replica, and how its losses were normalised."""

    def __init__(self) -> None:
        self.weight = 0.0  # this replica's weight in the update so far
        self.weighted = False  # a weighted loss was noted in this update
        self.plain = False  # a loss normalised by examples was noted in this update
        self.closed = False  # the last note was on an update's last micro-batch

    def _begin(self, last_micro_batch: bool) -> None:
        # Notes after an update's last micro-batch that no step finished (an evaluation pass with gradients on,
        # or a step never taken) belong to no update: a new one starts.
        if self.closed:
            self.weight, self.weighted, self.plain = 0.0, False, False
        self.closed = last_micro_batch

    def note_weighted(self, weight: float, last_micro_batch: bool) -> None:
        """Note one micro-batch's weighted loss of ``weight`` (its gradient waits for the update's total)."""
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

    def finish(self, parameters: Iterable[torch.Tensor], reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """At the update step: divide the gradients by the update's global weight (when weighted); start a new update.

        ``reduce_sum`` is the strategy's sum over replicas (a collective: every replica calls
        ``finish`` at the same update step, as it steps its optimizer).
        """
        weighted, weight = self.weighted, self.weight
        self.weight, self.weighted, self.plain, self.closed = 0.0, False, False, False
        if not weighted:
            return
        total = float(reduce_sum(torch.tensor([weight], dtype=torch.float64)).reshape(-1)[0].item())
        if total <= 0:  # no weight anywhere: every gradient is zero already
            return
        for p in parameters:
            if p.grad is not None:
                p.grad.div_(total)
