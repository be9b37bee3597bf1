"""Adapter between the Trainer and ``towers.precision``: autocast, backward and step, loss-scaler state."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

__all__ = ["FullPrecision", "resolve"]


class FullPrecision:
    """No autocast, no loss scaling: ``loss.backward(); optimizer.step()``."""

    scaler = None

    def autocast(self) -> ContextManager[Any]:
        """Return a context that changes nothing."""
        return contextlib.nullcontext()

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Back-propagate ``loss`` and apply one optimizer step."""
        loss.backward()
        optimizer.step()


def resolve(precision: Any) -> Any:
    """Return an object with ``autocast()``, ``backward_and_step(loss, optimizer)`` and ``scaler``."""
    if precision is None or precision in ("32", "fp32", "float32", 32):
        return FullPrecision()
    raise NotImplementedError("mixed precision in the Trainer waits for towers.precision")
