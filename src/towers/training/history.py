"""``History``: the per-epoch logs of a ``fit`` call, identical on every replica."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Mapping

from towers.training.callbacks.base import Callback

__all__ = ["History"]


class History(Callback):
    """Record every epoch's logs: ``history.history["loss"][i]`` is epoch ``history.epoch[i]``'s value.

    The values are reduced across replicas before they reach any callback, so every replica
    holds the same History. ``fit`` returns it; ``trainer.history`` keeps the last one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}
        self.params: dict[str, Any] = {}

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self.epoch.append(int(epoch))
        known = set(self.history)
        for key, value in (logs or {}).items():
            if key not in known:
                # A key first seen now (e.g. val_loss from a later epoch) is padded with NaN.
                self.history[key] = [math.nan] * (len(self.epoch) - 1)
            self.history[key].append(float(value))
        for key in known - set(logs or {}):
            self.history[key].append(math.nan)

    def __getitem__(self, key: str) -> list[float]:
        return self.history[key]

    def __len__(self) -> int:
        return len(self.epoch)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, History):
            return NotImplemented
        return self.state_dict() == other.state_dict()

    def __repr__(self) -> str:
        return f"History(epochs={self.epoch}, keys={sorted(self.history)})"

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"epoch": [...], "history": {name: [...]}}`` (plain lists, checkpoint-safe)."""
        return {"epoch": list(self.epoch), "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the recorded epochs with ``state`` (from ``state_dict``)."""
        self.epoch = [int(e) for e in state.get("epoch", [])]
        self.history = {str(k): [float(x) for x in v] for k, v in dict(state.get("history", {})).items()}

    def to_csv(self, path: str | Path) -> Path:
        """Write one row per epoch (``epoch`` then the metric columns, sorted) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = sorted(self.history)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["epoch", *keys])
            for i, epoch in enumerate(self.epoch):
                writer.writerow([epoch, *(repr(self.history[k][i]) for k in keys)])
        return path
