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
from typing import Any

from torch import nn

from towers.strategies.parameter_server.requests import RequestError
from towers.strategies.parameter_server.transport import Status

__all__ = ["ModelGenerations", "ModelTurnover"]


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

    def replaced(self, generation: int) -> bool:
        """True when a later model than ``generation`` was prepared (the ps tasks hold that one now)."""
        return len(self._models) > generation + 1

    def prepared(self, model: nn.Module) -> None:
        """Count ``model`` as prepared (after the ps tasks took it: a model they refused takes no generation)."""
        if self.of(model) == len(self._models):
            self._models.append(weakref.ref(model))


class ModelTurnover:
    """On one ps task: the latest of the job's models each worker registered (under the server's lock).

    Its dense shard and its embedding tables each hold one model; both replace theirs by a later
    one only once every live worker has moved to it (then none can still push for the earlier one).
    """

    def __init__(self, server: Any) -> None:
        self.server = server
        self.latest: dict[int, int] = {}  # worker -> the latest model it registered

    def arrive(self, w: int, generation: int, held: int, what: str) -> None:
        """Note that worker ``w`` moved to model ``generation``; ``held`` is the model ``what`` holds now.

        Raises:
            RequestError: ``generation`` is older than ``held`` (the workers prepared different models).
        """
        server = self.server
        if generation < held:
            raise RequestError(
                f"{server.who(w)} registers {what} of model {generation} of the job, but ps task {server.ps_index} "
                f"already holds those of model {held} (the script prepared a later model on the other workers). "
                "Every worker must prepare the same models in the same order.", Status.BAD_INPUT)
        self.latest[w] = generation
        server.cond.notify_all()

    def wait_for_all(self, generation: int, what: str) -> None:
        """Wait until every live worker registered model ``generation`` (or a later one)."""
        server = self.server
        behind = lambda: [v for v in server.active() if self.latest.get(v, -1) < generation]  # noqa: E731
        server.wait(lambda: not behind(), f"{what} of model {generation}", behind)
