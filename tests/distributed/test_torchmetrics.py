"""torchmetrics metrics given to Trainer under Mirrored (2 replicas) and parameter servers (1 ps + 2 workers).

Under PS torch's default process group also holds the ps task, so torchmetrics' own sync (a gather
over that group) waited forever at the first epoch end; the metrics now sync through the strategy.
Every value is checked against the same torchmetrics metric computed on the whole data at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers

torchmetrics = pytest.importorskip("torchmetrics", reason="torchmetrics is in the test extra")  # installed: never skips

pytestmark = pytest.mark.timeout(180)

N, GBS = 53, 8  # the last global batch holds 5 examples: 3 + 2 over two replicas

CASES = {
    "mirrored": (2, {"TOWERS_STRATEGY": "mirrored"}, {}),
    "ps_sync": (3, {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"}, {"mode": "sync", "timeout_s": 60,
                                                                     "exit_on_ps": False}),
}


def _metrics():
    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

    return {"accuracy": "accuracy",
            "tm_accuracy": MulticlassAccuracy(num_classes=3, average="micro"),   # sum states
            "tm_f1": MulticlassF1Score(num_classes=3, average="macro"),          # per-class sum states
            "tm_auroc": MulticlassAUROC(num_classes=3, thresholds=None)}         # list states, ragged per replica


def _replica(strategy_kwargs):
    strategy = towers.strategy_from_env(**strategy_kwargs)
    if getattr(strategy, "is_ps", False):
        return None  # a ps task served until the workers were done
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    y = (x[:, 0] - x[:, 2] > 0).long() + (x[:, 1] > 1).long()
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, metrics=_metrics(), strategy=strategy)
    history = trainer.fit((x, y), 2, GBS, validation_data=(x, y))
    evaluation = trainer.evaluate((x, y), 6)
    with torch.no_grad():
        logits = trainer.unwrapped_model(x.to(strategy.device)).cpu()
    reference = {name: float(metric(logits, y)) for name, metric in _metrics().items() if name != "accuracy"}
    reference["accuracy"] = float((logits.argmax(1) == y).float().mean())
    result = {"history": history.history, "evaluation": evaluation, "reference": reference}
    if hasattr(strategy, "ps_stats"):
        strategy.shutdown()
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchmetrics_sync_across_replicas_under_every_strategy(case):
    nprocs, env, kwargs = CASES[case]
    results = towers.spawn(_replica, nprocs, args=(kwargs,), timeout_s=150, env=env)
    workers = [r for r in results if r is not None]
    assert len(workers) == 2
    first, second = workers
    assert first["evaluation"] == second["evaluation"] and first["history"] == second["history"]
    evaluation, reference = first["evaluation"], first["reference"]
    for name in ("accuracy", "tm_accuracy", "tm_f1", "tm_auroc"):
        # evaluate() saw all 53 examples over both replicas: equal to the metric on the whole data
        assert evaluation[name] == pytest.approx(reference[name], abs=1e-6), name
    assert evaluation["tm_accuracy"] == pytest.approx(evaluation["accuracy"], abs=1e-6)
    assert len(first["history"]["tm_auroc"]) == 2 and len(first["history"]["val_tm_f1"]) == 2
    assert first["history"]["val_tm_accuracy"][-1] == pytest.approx(first["history"]["val_accuracy"][-1], abs=1e-6)
