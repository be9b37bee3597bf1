"""What every part of ``Trainer`` may read on ``self``: the Trainer's attributes, declared once (no values).

``Trainer`` is one class built from parts (``_trainer_epochs``, ``_trainer_steps``,
``_trainer_inference``), each a base class holding some of its methods. They all derive from this
declaration, so a type checker knows the state they share and the methods one part calls on another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from towers.data import BatchInfo
    from towers.diagnostics.throughput import ThroughputMeter
    from towers.strategies.base import Strategy
    from towers.training._state import TrainingProgress
    from towers.training._steps import MetricSet
    from towers.training.batches import BatchParts, LabelsArgument
    from towers.training.callbacks.base import CallbackList
    from towers.training.history import History
    from towers.training.metrics import ExternalMetric, Metric

__all__ = ["TrainerAttributes"]


class TrainerAttributes:
    """The attributes ``Trainer.__init__`` and ``fit`` set (see ``Trainer``)."""

    strategy: Strategy
    model: nn.Module
    optimizer: Any
    loss_fn: Any
    label_key: str
    prediction_key: str | int | None
    ignore_index: int
    metrics: list[Metric | ExternalMetric]
    clip_grad_norm: float | None
    breakdown_every: int | None
    seed: int
    stop_training: bool
    history: History
    progress: TrainingProgress
    log_every_n_steps: int
    throughput: ThroughputMeter
    step_batch_info: BatchInfo | None
    #: True once the training input moved this fit to the job's position (a replica group that joined a running job).
    joined_job: bool
    _train_metrics: MetricSet
    _val_metrics: MetricSet
    _passes_count: bool
    _shifted_labels: bool
    _labels_argument: LabelsArgument
    _callbacks: CallbackList
    _resume: dict[str, Any] | None
    _last_global_batch_size: int | None
    _train_batches: Any
    _unsynced: torch.Tensor | None
    _stop_pending: bool
    _last_train_logs: dict[str, float]
    _nonfinite_warning: str
    _said_no_labels: bool

    if TYPE_CHECKING:  # methods one part calls on another (defined in that part)
        def _train_step(self, batch: Any, info: Any) -> tuple[int, torch.Tensor]: ...
        def _sync_train_metrics(self) -> dict[str, float]: ...
        def _any_replica(self, flag: bool) -> bool: ...
        def _warn_nonfinite(self, logs: Any) -> None: ...
        def _own_loss_step(self, parts: BatchParts) -> tuple[torch.Tensor, torch.Tensor]: ...
        @property
        def unwrapped_model(self) -> nn.Module: ...
