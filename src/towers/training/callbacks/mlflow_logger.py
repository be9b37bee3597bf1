"""``MLflowLogger``: the Trainer's logs to an MLflow run, from the chief only."""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Mapping

from towers.errors import user_error
from towers.training.callbacks._tracking import TrackerLogger

__all__ = ["MLflowLogger"]

log = logging.getLogger(__name__)

_NOT_IN_A_NAME = re.compile(r"[^\w\-. :/]")  # what MLflow accepts in a metric or parameter name


def _mlflow_name(key: str) -> str:
    return _NOT_IN_A_NAME.sub("_", key)


def _store_error(tracking_uri: str | None, exc: Exception) -> Exception | None:
    """One line for a tracking store MLflow refuses to open (None: another error, raised as MLflow raised it).

    MLflow 3 refuses a ``file:`` store (or a plain folder) unless ``MLFLOW_ALLOW_FILE_STORE=true``, and its
    default store is ``sqlite:///mlflow.db``, which the client alone (``mlflow-skinny``, what
    ``towers[mlflow]`` installs) cannot open: it has no database driver.
    """
    text = str(exc)
    received = f"tracking_uri={tracking_uri!r}" + (" (MLFLOW_TRACKING_URI or MLflow's default)" if tracking_uri is None else "")
    if "MLFLOW_ALLOW_FILE_STORE" in text:
        return user_error("MLflowLogger cannot open its tracking store: MLflow 3 refuses a file store unless the "
                          "environment has MLFLOW_ALLOW_FILE_STORE=true", received,
                          "Point tracking_uri (or MLFLOW_TRACKING_URI) at your tracking server (http://host:5000), "
                          "set MLFLOW_ALLOW_FILE_STORE=true to keep a local file: folder, or install the full mlflow "
                          "(pip install mlflow) and use tracking_uri='sqlite:///mlflow.db'.", cls=RuntimeError)
    if "sqlite" in text or "sqlalchemy" in text.lower():
        return user_error("MLflowLogger cannot open its tracking store: a database store (MLflow 3's default is "
                          "sqlite:///mlflow.db) needs the full mlflow package, and only its client (mlflow-skinny) is "
                          "installed", received,
                          "Point tracking_uri (or MLFLOW_TRACKING_URI) at your tracking server (http://host:5000), "
                          "install the full mlflow (pip install mlflow), or use tracking_uri='file:./mlruns' with "
                          "MLFLOW_ALLOW_FILE_STORE=true in the environment.", cls=RuntimeError)
    return None


class MLflowLogger(TrackerLogger):
    """Log every numeric key of the epoch logs (and of every ``log_every_n_steps``-th step's) to an MLflow run, on the chief.

    Epoch logs keep their names (``loss``, ``val_loss``, ``lr``, ``examples_per_second``, ``time/forward``, ...)
    at step ``epoch``; step logs are ``batch/<name>`` at step ``global_step``. Fit's parameters (``epochs``,
    ``steps``, ``global_batch_size``, ``num_replicas``, ``strategy``) are logged once as the run's params.

    The run: ``run_id`` if given, else the run started with ``mlflow.start_run()`` when ``tracking_uri`` is None
    (both left open), else a new run named ``run_name`` in ``experiment_name`` that ends with ``fit``. Talks to the store
    through an ``MlflowClient``, so no global MLflow state is changed. Other replicas do nothing and never import
    mlflow. Needs ``pip install 'towers[mlflow]'`` (the ``mlflow-skinny`` client).

    Args:
        experiment_name: the experiment of a new run (MLflow's ``Default`` when None).
        tracking_uri: the tracking store. None: MLflow's own (``MLFLOW_TRACKING_URI``), and a run already
            started with ``mlflow.start_run()`` is logged into.
        run_name: the name of a new run.
        run_id: log into this existing run (left open).
        tags: tags of a new run.
        log_every_n_steps: also log every that many steps' batch logs; None: the epochs only.

    Raises:
        ImportError: at construction, on every replica, when mlflow is not installed.
        ValueError: when ``log_every_n_steps`` is neither None (epochs only) nor a positive integer.
    """

    package = "mlflow"
    extra = "mlflow"

    def __init__(self, experiment_name: str | None = None, *, tracking_uri: str | None = None,
                 run_name: str | None = None, run_id: str | None = None, tags: Mapping[str, str] | None = None,
                 log_every_n_steps: int | None = 50):
        super().__init__(log_every_n_steps=log_every_n_steps)
        self.experiment_name = experiment_name
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = run_id
        self._given_run_id = run_id
        self._client: Any = None
        self._owns_run = False

    def _start(self, params: dict[str, Any]) -> None:
        mlflow = self._import()
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        try:  # MLflow opens the store here: a store it refuses is one line naming the fix
            client = self._client = mlflow.tracking.MlflowClient(tracking_uri=self.tracking_uri)
        except MlflowException as exc:
            error = _store_error(self.tracking_uri, exc)
            if error is None:
                raise
            raise error from None
        run_id = self._given_run_id
        if run_id is None and self.tracking_uri is None and mlflow.active_run() is not None:
            run_id = mlflow.active_run().info.run_id
        self._owns_run = run_id is None
        if run_id is None:
            name = self.experiment_name or "Default"
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
            run_id = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id
            logged: dict[str, str] = {}
        else:
            logged = client.get_run(run_id).data.params
            if self.tags:
                client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in self.tags.items()])
        self.run_id = run_id
        new = []
        for key, value in params.items():
            key, value = _mlflow_name(key), str(value)
            if key not in logged:
                new.append(Param(key, value))
            elif logged[key] != value:  # MLflow refuses to change a logged parameter
                log.warning("MLflowLogger: run %s already has the parameter %s=%s; this fit's %s is not logged.",
                            run_id, key, logged[key], value)
        if new:
            client.log_batch(run_id, params=new)

    def _log(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(_mlflow_name(k), v, now_ms, step) for k, v in metrics.items()])

    def _finish(self) -> None:
        if self._owns_run:
            self._client.set_terminated(self.run_id)
        self._client = None
