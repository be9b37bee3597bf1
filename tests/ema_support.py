"""The plain one-device loop with torch's EMA, the reference of the EMA and model-copy tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def plain_ema(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, decay: float,
              batch: int) -> AveragedModel:
    """Train ``model`` one epoch on one device without towers (SGD with momentum, batches in order) with
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` updated after each step; return the average."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    for start in range(0, len(x), batch):
        F.cross_entropy(model(x[start:start + batch]), y[start:start + batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
        averaged.update_parameters(model)
    return averaged
