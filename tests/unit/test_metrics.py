"""Metrics: values, example-weighted reduction over uneven batches, specs and names."""

from __future__ import annotations

import math

import pytest
import torch

from towers.training import metrics as M


def _logits(labels: list[int], predicted: list[int], classes: int = 4) -> torch.Tensor:
    out = torch.zeros(len(labels), classes)
    out[torch.arange(len(labels)), torch.tensor(predicted)] = 5.0
    return out


def test_accuracy_and_top_k():
    y = torch.tensor([0, 1, 2, 3])
    logits = _logits([0, 1, 2, 3], [0, 1, 0, 0])
    assert M.accuracy(logits, y).tolist() == [1.0, 1.0, 0.0, 0.0]
    logits[2, 2] = 1.0  # second-best class is the label
    assert M.top_k_accuracy(logits, y, k=2).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert M.top_k_accuracy(logits, y, k=10).tolist() == [1.0] * 4  # k above the class count: all hits
    assert M.accuracy(torch.tensor([0.9, 0.2]), torch.tensor([1.0, 1.0])).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="accuracy expects"):
        M.accuracy(torch.zeros(3, 2, 2), torch.zeros(5))


def test_uneven_batches_are_weighted_by_examples_not_averaged():
    """Two replicas, an uneven last batch: the reduced value equals the metric over all examples."""
    torch.manual_seed(0)
    y = torch.randint(0, 4, (23,))
    logits = torch.randn(23, 4)
    acc, loss = M.Accuracy(), M.Mean("loss")
    per_example = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    # global batches of 8, 8, 7 split over 2 replicas as 4+4, 4+4, 4+3
    for start, size in ((0, 8), (8, 8), (16, 7)):
        shards = [slice(start, start + (size + 1) // 2), slice(start + (size + 1) // 2, start + size)]
        acc.accumulate(sum(acc.local_state(logits[s], y[s]) for s in shards))  # what reduce("sum") does
        loss.accumulate(sum(loss.local_state(per_example[s]) for s in shards))
    assert acc.result() == pytest.approx(M.accuracy(logits, y).double().mean().item(), abs=1e-12)
    assert loss.result() == pytest.approx(per_example.double().mean().item(), rel=1e-12)
    # the naive average of per-replica averages differs for this split
    last = [M.accuracy(logits[16:20], y[16:20]).mean(), M.accuracy(logits[20:23], y[20:23]).mean()]
    naive = [M.accuracy(logits[i:i + 4], y[i:i + 4]).mean() for i in (0, 4, 8, 12)] + last
    assert acc.result() != pytest.approx(torch.stack(naive).mean().item(), abs=1e-6)


def test_state_reset_and_nan_before_data():
    acc = M.Accuracy()
    assert acc.result() != acc.result()  # NaN
    acc.accumulate(torch.tensor([3.0, 4.0], dtype=torch.float64))
    state = acc.state_dict()
    acc.reset()
    acc.load_state_dict(state)
    assert acc.result() == 0.75
    with pytest.raises(ValueError, match="expects 2 sums"):
        acc.load_state_dict({"totals": torch.zeros(3)})


class _FakeTorchMetric:
    def __init__(self):
        self.reset()

    def update(self, preds, target):
        self.n += len(target)

    def compute(self):
        return torch.tensor(float(self.n))

    def reset(self):
        self.n = 0


def test_specs_and_names():
    names = [m.name for m in M.build_metrics(["accuracy", "top5_accuracy", "top_3_acc", M.TopKAccuracy(2)])]
    assert names == ["accuracy", "top5_accuracy", "top_3_acc", "top2_accuracy"]
    assert M.get_metric("top5_accuracy").k == 5

    def hinge(y_pred, y_true):
        return (1 - y_pred[:, 0]).clamp(min=0)

    custom = M.get_metric(hinge)
    assert custom.name == "hinge" and isinstance(custom, M.MeanMetricWrapper)
    external = M.get_metric(_FakeTorchMetric())
    assert isinstance(external, M.ExternalMetric) and external.name == "fake_torch_metric"
    external.update(torch.zeros(3, 2), torch.zeros(3))
    assert external.result() == 3.0
    assert [m.name for m in M.build_metrics({"acc1": "accuracy"})] == ["acc1"]
    with pytest.raises(ValueError, match="Unknown metric 'f1'.*top5_accuracy"):
        M.get_metric("f1")
    with pytest.raises(ValueError, match="unique"):
        M.build_metrics(["accuracy", "accuracy"])
    with pytest.raises(ValueError, match="not 'loss'"):
        M.build_metrics({"loss": "accuracy"})
    with pytest.raises(TypeError, match="as a metric"):
        M.get_metric(3)
    with pytest.raises(ValueError, match="positive integer"):
        M.TopKAccuracy(0)


def test_keras_style_update_and_result_in_a_custom_loop():
    from towers.metrics import Mean, SparseCategoricalAccuracy

    accuracy, loss = SparseCategoricalAccuracy("train_accuracy"), Mean("train_loss")
    assert Mean().name == "mean"
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    accuracy.update(logits[:2], torch.tensor([0, 0]))  # 1 of 2
    accuracy.update_state(torch.tensor([0]), logits[2:])  # Keras' order: labels first; 1 of 1
    loss.update_state(torch.tensor([1.0, 2.0]))
    loss.update(torch.tensor(6.0))
    assert accuracy.result() == pytest.approx(2 / 3)
    assert loss.result() == pytest.approx(3.0)
    assert accuracy.result() == pytest.approx(2 / 3)  # result() twice counts nothing twice
    accuracy.reset_state()
    assert math.isnan(accuracy.result())


def test_metric_result_combines_every_replicas_updates_through_the_strategy():
    from towers.metrics import Accuracy
    from towers.strategies.context import CURRENT_STRATEGY

    class TwoReplicas:  # the other replica saw 3 examples, all right
        num_replicas_in_sync = 2

        def reduce(self, op, value):
            assert op == "sum"
            return value + torch.tensor([3.0, 3.0], dtype=torch.float64)

    metric = Accuracy()
    token = CURRENT_STRATEGY.set(TwoReplicas())  # as inside strategy.run
    try:
        metric.update(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))  # this replica: 0 of 1
    finally:
        CURRENT_STRATEGY.reset(token)
    assert metric.result() == pytest.approx(3 / 4)
