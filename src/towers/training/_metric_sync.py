"""The training metrics' running sums: kept on each replica between reductions, reduced across replicas on request."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from towers._logging import get_logger
from towers.strategies.base import PeerLostError, Strategy
from towers.training._steps import MetricSet

__all__ = ["MetricSync"]

log = get_logger(__name__)


class MetricSync:
    """The training metrics of a Trainer (``metrics``) and this replica's sums of the steps not yet reduced.

    The epoch loop adds each step's sums (``add``) and asks for a reduction (``sync``: one collective) at the
    steps it chooses; between reductions the logs are those of the last one. Also says, once per Trainer, that
    a reduced loss was not finite (``warn_nonfinite``) or that the reduced batches had no label token.
    ``ignore_index`` is the Trainer's (named in that warning).
    """

    def __init__(self, strategy: Strategy, metrics: MetricSet, *, ignore_index: int):
        self.strategy = strategy
        self.metrics = metrics
        self.ignore_index = ignore_index
        self.unsynced: torch.Tensor | None = None  # metric sums of steps not yet reduced across replicas
        self.last_logs: dict[str, float] = {}  # the logs of the last reduction of this epoch
        self._nonfinite_warning = "unseen"  # -> "due" when a reduced loss is not finite -> "said"
        self._said_no_labels = False  # warned that the batches reduced at a step had no label token

    def begin_epoch(self, *, fresh: bool) -> None:
        """An epoch starts: nothing pending. ``fresh``: at its first step (a mid-epoch resume keeps the restored
        running sums and starts without logs as well)."""
        self.unsynced = None
        if fresh:
            self.metrics.reset()
            self.last_logs = {}

    def add(self, sums: torch.Tensor) -> None:
        """Keep a step's metric sums (on the device) until the next reduction."""
        self.unsynced = sums if self.unsynced is None else self.unsynced + sums

    def sync(self, global_step: int) -> dict[str, float]:
        """Reduce the metric sums kept since the last call (one collective); return the logs through this step.

        When a peer was lost since the step began (``PeerLostError``, fault-tolerant strategies), the logs
        stay those of the last synchronisation and this replica keeps its sums for the next one of the
        epoch (at the epoch's end there is none: its logs then cover the steps up to the last one).
        """
        if self.unsynced is not None:
            try:
                reduced = self.strategy.reduce("sum", self.unsynced).detach().to("cpu", torch.float64)
            except PeerLostError as exc:
                log.warning("training metrics not reduced at global step %d (%s); the logs keep the values of the "
                            "last reduction, and this replica's sums since are added at the next one of this epoch",
                            global_step, str(exc).splitlines()[0])
                return dict(self.last_logs)
            self.unsynced = None
            self.metrics.accumulate(reduced)
            nonfinite, label_count = float(reduced[-1]), float(reduced[1])  # on the host already: no wait
            self.last_logs = {**self.metrics.results(external=False), "nonfinite_replicas": nonfinite}
            if nonfinite > 0 and self._nonfinite_warning == "unseen":
                self._nonfinite_warning = "due"  # said after the callbacks, unless one of them stops training
            if label_count == 0:  # the loss's count: no label token in any batch since the last reduction
                self._warn_no_labels(global_step)
        return dict(self.last_logs)

    def warn_nonfinite(self, logs: Mapping[str, Any], *, stopping: bool) -> None:
        """Warn once, on the chief, when a loss was not finite and no callback stopped training for it (``stopping``)."""
        if self._nonfinite_warning != "due":
            return
        self._nonfinite_warning = "said"  # once per Trainer; every replica saw the same reduced value
        if self.strategy.is_chief and not stopping:
            warnings.warn(
                f"The training loss is not finite (NaN or inf) on {int(logs.get('nonfinite_replicas', 0))} "
                "replica-step(s) reduced at this step; training goes on with it. Add "
                "towers.callbacks.TerminateOnNaN() to fit's callbacks to stop, or lower the learning rate / check the "
                "data.", RuntimeWarning, stacklevel=3)

    def _warn_no_labels(self, global_step: int) -> None:
        """Warn once, on the chief, that the batches reduced now had no label token (every replica decided alike)."""
        if self._said_no_labels:
            return
        self._said_no_labels = True
        if self.strategy.is_chief:
            warnings.warn(
                f"The training batches reduced at global step {global_step} had no label token: every "
                f"label equals ignore_index={self.ignore_index} on every replica, so their loss is a mean over nothing "
                "(NaN in the logs while no batch of the epoch had a label) and they teach the model nothing. Check "
                "how the batches are labelled: the collator (e.g. DataCollatorForLanguageModeling(tokenizer, "
                "mlm=False) copies input_ids into labels), a prompt mask that covers whole sequences, truncation that "
                "cuts off every answer; or pass Trainer(ignore_index=...) as your labels mark padding.",
                RuntimeWarning, stacklevel=4)
