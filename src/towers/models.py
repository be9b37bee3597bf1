"""Small reference models used by the demo, the examples and every benchmark."""

from __future__ import annotations

from torch import nn

__all__ = ["SeedCNN"]


class SeedCNN(nn.Sequential):
    """The project's seed CNN: ``Conv2d(1,32,3) -> ReLU -> MaxPool2d(2) -> Flatten -> Linear(5408,64) -> ReLU -> Linear(64,10)``.

    Input ``[B, 1, 28, 28]``; output ``[B, num_classes]`` logits. ~347k parameters.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 13 * 13, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )
