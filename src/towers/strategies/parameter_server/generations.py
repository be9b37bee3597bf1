"""Which of a job's models a ``prepare`` registers on the ps tasks.

A script may train more than one model in one job (a custom loop, then a ``Trainer`` on a new model).
Each model gets a generation, 0, 1, ... in the order the script prepares it, the same on every worker;
preparing the same module again keeps its number. The ps tasks replace generation ``g`` by ``g + 1``
once every live worker has registered ``g + 1`` (none can still push for ``g``), starting from the
chief's values with a new optimizer state, and its ``ShardedEmbedding`` tables from fresh rows, as a
second model does under every other strategy.
"""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["ModelGenerations"]


class ModelGenerations:
    """The models one worker prepared, in order."""

    def __init__(self) -> None:
        self._models: list[weakref.ref[nn.Module]] = []

    def of(self, model: nn.Module) -> int:
        """Return ``model``'s generation: its place among the models prepared, or the next one for a new model."""
        for i, ref in enumerate(self._models):
            if ref() is model:
                return i
        return len(self._models)

    def prepared(self, model: nn.Module) -> None:
        """Count ``model`` as prepared (after the ps tasks took it: a model they refused takes no generation)."""
        if self.of(model) == len(self._models):
            self._models.append(weakref.ref(model))
