"""``towers.metrics``: the Trainer's metrics, importable as the docs write them (``from towers.metrics import X``).

The classes live in ``towers.training.metrics``; this module is the public path to them.
"""

from towers.training.metrics import (
    Accuracy,
    ExternalMetric,
    Mean,
    MeanMetricWrapper,
    Metric,
    SparseCategoricalAccuracy,
    TopKAccuracy,
    accuracy,
    build_metrics,
    get_metric,
    top_k_accuracy,
)

__all__ = [
    "Metric", "Mean", "MeanMetricWrapper", "Accuracy", "SparseCategoricalAccuracy", "TopKAccuracy", "ExternalMetric",
    "accuracy", "top_k_accuracy", "get_metric", "build_metrics",
]
