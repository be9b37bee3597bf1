"""What ``WandbLogger`` and ``MLflowLogger`` share: a run on the chief only, every numeric key, fit's parameters.

The tracker's package is looked up (not imported) when the callback is built, on every replica, so a
missing package fails every process at once; only the chief imports it, when training begins.
"""

from __future__ import annotations

import importlib
import importlib.util
import numbers
from types import ModuleType
from typing import Any, ClassVar, Mapping

from towers.errors import InvalidArgumentError
from towers.training.callbacks.base import Callback

__all__ = ["TrackerLogger", "numeric_logs"]


def _missing(cls_name: str, package: str, extra: str, detail: str = "") -> ImportError:
    return ImportError(
        f"{cls_name} needs the {package} package, which is not installed{f' ({detail})' if detail else ''}. "
        f"Install it with: pip install 'towers[{extra}]'  (or: pip install {extra_requirement(extra)}).")


def extra_requirement(extra: str) -> str:
    """The distribution that towers' optional extra ``extra`` installs (``wandb`` or ``mlflow-skinny``)."""
    return {"wandb": "wandb", "mlflow": "mlflow-skinny"}[extra]


def numeric_logs(logs: Mapping[str, Any] | None) -> dict[str, float]:
    """Return the keys of ``logs`` whose value is a real number (booleans and everything else left out), as floats."""
    return {k: float(v) for k, v in (logs or {}).items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


class TrackerLogger(Callback):
    """Base of the hosted-tracker loggers: the chief starts a run, logs fit's parameters once, then metrics.

    Epoch logs are logged under their own names at step ``epoch``; every ``log_every_n_steps``-th step of
    each epoch (its first included, as the Trainer counts its reductions) the batch logs are logged as
    ``batch/<name>`` at step ``global_step``, and so is every step breakdown report (``batch/time/<phase>``)
    at its own step between them (``log_every_n_steps=None``: epochs only). Subclasses implement ``_start``,
    ``_log`` and ``_finish``.

    Raises:
        ValueError: when ``log_every_n_steps`` is neither None nor a positive integer.
        ImportError: at construction, on every replica, when the tracker's package is not installed.
    """

    package: ClassVar[str]  # the module imported on the chief
    extra: ClassVar[str]    # towers' optional extra that installs it

    def __init__(self, *, log_every_n_steps: int | None = 50):
        super().__init__()
        if log_every_n_steps is not None and (
                isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise InvalidArgumentError(f"log_every_n_steps must be a positive integer, or None to log epochs only. "
                                       f"Received: {log_every_n_steps!r}. Use e.g. log_every_n_steps=50.")
        try:
            found = importlib.util.find_spec(self.package) is not None
        except (ImportError, ValueError):  # ValueError: blocked with sys.modules[package] = None
            found = False
        if not found:
            raise _missing(type(self).__name__, self.package, self.extra)
        self.log_every_n_steps = log_every_n_steps
        self._active = False

    def _import(self) -> ModuleType:
        try:
            return importlib.import_module(self.package)
        except ImportError as exc:
            raise _missing(type(self).__name__, self.package, self.extra, str(exc)) from exc

    def run_params(self) -> dict[str, Any]:
        """Fit's parameters as logged once per run: ``epochs``, ``steps``, ``global_batch_size``, ``num_replicas``,
        ``strategy`` (those known)."""
        params = {k: v for k, v in self.params.items() if v is not None}
        params["strategy"] = self.trainer.strategy.name
        return params

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        if not (self.attached and self.trainer.strategy.is_chief):
            return  # other replicas never import the tracker
        self._start(self.run_params())
        self._active = True

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if not self._active or self.log_every_n_steps is None:
            return
        values = numeric_logs(logs)
        step = int(values.pop("global_step", 0))
        if batch % self.log_every_n_steps:
            # Off the period, a step breakdown's report (its time/<phase> keys, at its step) is logged alone.
            values = {k: v for k, v in values.items() if k.startswith("time/")}
        if values:
            self._log({f"batch/{k}": v for k, v in values.items()}, step=step, axis="global_step")

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._active:
            self._log(numeric_logs(logs), step=epoch, axis="epoch")

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._active:
            self._active = False
            self._finish()

    def _start(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def _log(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError
