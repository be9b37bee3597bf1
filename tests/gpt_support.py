"""The per-example loss of a token model that the model-parallel tests train towers' GPT with."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean token loss (one value per example)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).mean(1)
