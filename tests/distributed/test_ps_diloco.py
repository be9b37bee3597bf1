"""DiLoCo on the parameter servers (``mode="diloco"``): 2 workers + 1 ps task, one spawn, seven runs in it.

* ``sync_every=1`` with outer SGD of rate 1 and no momentum, inner SGD: the same parameters as ``mode="sync"``.
  Why: each worker takes one SGD step on its own mean gradient, ``local_i = p - lr * g_i``; the ps averages the
  changes ``p - local_i`` (weighted by examples, equal shares here) and steps ``p - 1 * mean_i(lr * g_i)``, which is
  ``p - lr * g`` with ``g`` the global batch's mean gradient: sync mode's update. Only the rounding differs (the
  change is taken as a difference of parameters), hence a float tolerance.
* ``sync_every=4`` with DiLoCo's Nesterov outer step and inner Adam: the parameters of a plain-torch DiLoCo written
  in this file (two local models, their changes averaged, ``torch.optim.SGD(nesterov=True)`` on the global copy);
  6 steps per epoch, so each epoch has a window of 4 and one of 2 (the end of a pass ends a window). Loss falls.
* ``Trainer.fit`` under DiLoCo trains; int8 changes with 2 fragments train too and send fewer bytes per outer step;
  async outer rounds (each change applied on arrival, staleness 1) train, and so does ``overlap=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers

pytestmark = pytest.mark.timeout(240)

PS_ENV = {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"}
N, B, EPOCHS, H = 48, 8, 2, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def _full_loss(model: nn.Module) -> float:
    x, y = _data()
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def _loop(strategy: towers.Strategy, inner: str) -> dict:
    """The user's custom loop (README's shape): the same code under mode sync and diloco."""
    with strategy.scope():
        net = _model()
        optimizer = (torch.optim.SGD(net.parameters(), lr=0.1) if inner == "sgd"
                     else torch.optim.Adam(net.parameters(), lr=0.01))
    net, optimizer = strategy.prepare(net, optimizer)
    x, y = _data()
    batches = strategy.distribute_dataset(torch.utils.data.TensorDataset(x, y), B, shuffle=False)

    def step(xb, yb):
        loss = towers.compute_average_loss(F.cross_entropy(net(xb), yb, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for _ in range(EPOCHS):
        for xb, yb in batches:
            strategy.run(step, args=(xb, yb))
    model = strategy.unwrap(net)
    return {"params": [p.detach().clone() for p in model.parameters()], "loss": _full_loss(model),
            "wire": strategy.wire_stats()}


def _worker() -> dict:
    out: dict = {}
    runs = {"sync": dict(mode="sync", shared_memory=False), "h1": dict(mode="diloco", sync_every=1, outer_optimizer="sgd"),
            "h4": dict(mode="diloco", sync_every=H),
            "int8": dict(mode="diloco", sync_every=H, compression="int8", fragments=2),
            "async": dict(mode="diloco", sync_every=H, outer_mode="async", staleness=1),
            "overlap": dict(mode="diloco", sync_every=H, overlap=True)}
    for name, options in runs.items():
        strategy = towers.strategy_from_env(timeout_s=60, exit_on_ps=False, **options)
        if strategy.is_ps:
            out[name] = strategy.ps_stats()[0]
            continue
        out[name] = _loop(strategy, "sgd" if name in ("sync", "h1") else "adam")
        strategy.shutdown()
    strategy = towers.strategy_from_env(timeout_s=60, exit_on_ps=False, mode="diloco", sync_every=2)
    if strategy.is_ps:
        out["fit"] = strategy.ps_stats()[0]
        return out
    with strategy.scope():
        net = _model()
        optimizer = torch.optim.Adam(net.parameters(), lr=0.02)
    trainer = towers.Trainer(net, optimizer, loss=F.cross_entropy, strategy=strategy)
    history = trainer.fit(torch.utils.data.TensorDataset(*_data()), epochs=3, global_batch_size=B)
    out["fit"] = {"loss": history.history["loss"], "wire": strategy.wire_stats(),
                  "params": [p.detach().clone() for p in net.parameters()]}
    strategy.shutdown()
    return out


def _reference_diloco() -> tuple[list[torch.Tensor], float]:
    """DiLoCo in plain torch: 2 local models with their own Adam, every H steps (and at an epoch's end) the averaged
    change is the outer SGD-Nesterov's gradient on the global copy; the local models restart from it."""
    x, y = _data()
    global_model = _model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    locals_ = [_model() for _ in range(2)]
    inners = [torch.optim.Adam(m.parameters(), lr=0.01) for m in locals_]

    def outer_step() -> None:
        for p_global, *p_local in zip(global_model.parameters(), *(m.parameters() for m in locals_)):
            p_global.grad = sum(p_global.detach() - p.detach() for p in p_local) / len(p_local)
        outer.step()
        outer.zero_grad()
        for m in locals_:
            m.load_state_dict(global_model.state_dict())

    for _ in range(EPOCHS):
        steps = 0
        for g in range(N // B):
            for r, (m, inner) in enumerate(zip(locals_, inners)):
                lo = g * B + r * B // 2
                F.cross_entropy(m(x[lo:lo + B // 2]), y[lo:lo + B // 2]).backward()
                inner.step()
                inner.zero_grad()
            steps += 1
            if steps == H:
                outer_step()
                steps = 0
        if steps:
            outer_step()
    return [p.detach() for p in global_model.parameters()], _full_loss(global_model)


def test_diloco_equals_sync_at_h1_and_a_plain_torch_diloco_at_h4():
    chief, other, ps = towers.spawn(_worker, 3, timeout_s=200, env=PS_ENV)
    start = _full_loss(_model())
    for worker in (chief, other):
        # H=1, outer SGD(1.0): sync mode's parameters
        for a, b in zip(worker["h1"]["params"], worker["sync"]["params"]):
            assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
        assert ps["h1"]["version"] == ps["sync"]["version"] == EPOCHS * N // B  # one outer step per step
    # H=4: the plain-torch DiLoCo, on both workers (they hold the global values after the last pass)
    reference, reference_loss = _reference_diloco()
    for worker in (chief, other):
        for a, b in zip(worker["h4"]["params"], reference):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert ps["h4"]["version"] == EPOCHS * 2  # windows of 4 and 2 steps per epoch
    assert chief["h4"]["loss"] == pytest.approx(reference_loss, abs=1e-5) and reference_loss < 0.8 * start
    # DiLoCo's counts and bytes: every example once per epoch, 4 outer pushes per worker
    wire = chief["h4"]["wire"]
    assert wire["examples"] == EPOCHS * N // 2 and wire["inner_steps"] == EPOCHS * N // B and wire["outer_steps"] == 4
    assert wire["bytes_per_example"] == pytest.approx(wire["bytes_sent"] / wire["examples"])
    assert wire["outer_bytes_sent"] < chief["sync"]["wire"]["bytes_sent"] / 2  # 4 pushes against 12
    # int8 with 2 fragments: trains, and an outer push carries about a quarter of half the model
    int8 = chief["int8"]
    assert int8["loss"] < 0.8 * start and ps["int8"]["version"] == 4
    assert int8["wire"]["outer_bytes_sent"] < 0.5 * wire["outer_bytes_sent"]
    # async outer rounds: each worker's change applied on arrival (4 per worker), within the staleness bound
    assert ps["async"]["version"] == 2 * 4 and ps["async"]["max_lead"] <= 1 and ps["async"]["mode"] == "async"
    assert chief["async"]["loss"] < 0.8 * start
    # overlap: each outer push's reply read one inner step later; the last one before the pass ends, so both
    # workers end on the global values
    assert ps["overlap"]["version"] == 4 and chief["overlap"]["loss"] < 0.8 * start
    assert all(torch.equal(a, b) for a, b in zip(chief["overlap"]["params"], other["overlap"]["params"])), \
        [(a - b).abs().max().item() for a, b in zip(chief["overlap"]["params"], other["overlap"]["params"])]
    assert not all(torch.equal(a, b) for a, b in zip(chief["overlap"]["params"], chief["h4"]["params"]))
    # Trainer.fit under DiLoCo: the loss falls; both workers end on the same (global) parameters
    assert chief["fit"]["loss"][-1] < 0.8 * chief["fit"]["loss"][0]
    assert all(torch.equal(a, b) for a, b in zip(chief["fit"]["params"], other["fit"]["params"]))
    assert chief["fit"]["wire"]["outer_steps"] == 3 * 3  # 6 steps per epoch, H=2
