"""``WandbLogger``: the Trainer's logs to a Weights & Biases run, from the chief only."""

from __future__ import annotations

import os
from typing import Any, Mapping

from towers.training.callbacks._tracking import TrackerLogger

__all__ = ["WandbLogger"]


class WandbLogger(TrackerLogger):
    """Log every numeric key of the epoch logs (and of every ``log_every_n_steps``-th step's) to a W&B run, on the chief.

    Epoch logs keep their names (``loss``, ``val_loss``, ``lr``, ``examples_per_second``, ``time/forward``, ...)
    against the step metric ``epoch``; step logs are ``batch/<name>`` against ``global_step``. Fit's parameters
    (``epochs``, ``steps``, ``global_batch_size``, ``num_replicas``, ``strategy``) and ``config`` go to the
    run's config. A run already started with ``wandb.init`` is logged into and left open; otherwise the
    logger starts one at the start of ``fit`` (``wandb.init(project=..., name=..., dir=..., mode=...,
    **init_kwargs)``) and finishes it at its end. ``mode="offline"`` writes the run under ``dir`` for a later
    ``wandb sync``. Other replicas do nothing and never import wandb. Needs ``pip install 'towers[wandb]'``.

    Args:
        project: the W&B project of a new run.
        name: the name of a new run.
        dir: where a new run writes its files (its offline copy under ``mode="offline"``).
        mode: ``"online"``, ``"offline"`` (for a later ``wandb sync``) or ``"disabled"``.
        config: more values for the run's config.
        log_every_n_steps: also log every that many steps' batch logs; None: the epochs only.
        **init_kwargs: more arguments for ``wandb.init``.

    Raises:
        ImportError: at construction, on every replica, when wandb is not installed.
        ValueError: when ``log_every_n_steps`` is neither None (epochs only) nor a positive integer.
    """

    package = "wandb"
    extra = "wandb"

    def __init__(self, project: str | None = None, *, name: str | None = None,
                 dir: str | os.PathLike[str] | None = None, mode: str | None = None,
                 config: Mapping[str, Any] | None = None, log_every_n_steps: int | None = 50, **init_kwargs: Any):
        super().__init__(log_every_n_steps=log_every_n_steps)
        self.init_kwargs: dict[str, Any] = {k: v for k, v in (("project", project), ("name", name), ("mode", mode))
                                            if v is not None}
        if dir is not None:
            self.init_kwargs["dir"] = os.fspath(dir)
        self.init_kwargs.update(init_kwargs)
        self.config = dict(config or {})
        self.run: Any = None
        self._owns_run = False
        self._epoch_keys: set[str] = set()

    def _start(self, params: dict[str, Any]) -> None:
        wandb = self._import()
        values = {**params, **self.config}
        self._owns_run = wandb.run is None
        if self._owns_run:
            if self.init_kwargs.get("dir"):
                os.makedirs(self.init_kwargs["dir"], exist_ok=True)
            self.run = wandb.init(config=values, **self.init_kwargs)
        else:
            self.run = wandb.run
            self.run.config.update(values, allow_val_change=True)
        self._epoch_keys = set()
        self.run.define_metric("global_step")
        self.run.define_metric("epoch")
        self.run.define_metric("batch/*", step_metric="global_step")

    def _log(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        if axis == "epoch":
            for key in metrics.keys() - self._epoch_keys:
                self.run.define_metric(key, step_metric="epoch")
            self._epoch_keys.update(metrics)
        self.run.log({axis: step, **metrics})

    def _finish(self) -> None:
        if self._owns_run:
            self.run.finish()
        self.run = None
