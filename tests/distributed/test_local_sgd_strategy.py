"""A strategy defined outside towers, added by the recipe of docs/architecture.md ("Adding a strategy").

``LocalSGDStrategy`` (below, registered as ``"local_sgd"`` with ``towers.strategies.register_strategy``)
keeps Mirrored's processes, process group, data split, collectives and checkpoints, and changes
only what the recipe says a synchronous strategy overrides: ``_wrap_model`` (no DDP: each replica
steps on its own share of the global batch) and ``_set_gradient_sync`` (nothing to switch), plus
its own ``prepare``, which starts the replicas from rank 0's weights and averages the parameters
after every ``sync_every``-th update. No towers source file changed for it.

One spawn of 2 CPU replicas runs a plain loop with ``sync_every=1`` and ``sync_every=3`` and
``Trainer.fit`` with ``sync_every=1``; the parent checks: k=1 is one device's SGD on the whole
batch (plain torch, ``atol=1e-6``: averaging the replicas' steps rounds differently from one mean
gradient), k=3 is not, and after each averaging step the replicas hold bitwise equal parameters
(and different ones between averages: they really step alone).
"""

from __future__ import annotations

from typing import Any, Mapping

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import towers
from towers.strategies import register_strategy
from towers.strategies.mirrored import MirroredStrategy

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH, EXAMPLES, EPOCHS, LR, ATOL = 16, 64, 2, 0.1, 1e-6


class LocalSGDStrategy(MirroredStrategy):
    """Local SGD: every replica steps on its own share of each global batch; the parameters are averaged over the
    replicas after every ``sync_every``-th update (``sync_every=1``: one device's SGD on the global batch)."""

    name = "local_sgd"

    def __init__(self, *, sync_every: int = 1, **options: Any) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1. Received: {sync_every!r}. Use e.g. sync_every=4.")
        self.sync_every = sync_every
        super().__init__(**options)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        for tensor in [*model.parameters(), *model.buffers()]:  # every replica starts from rank 0's weights
            dist.broadcast(tensor.data, src=0)
        return model  # no DDP: nothing sums the gradients

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Nothing to switch: gradients stay on their replica."""

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                compile: bool | Mapping[str, Any] = False) -> tuple[nn.Module, Any]:
        """Return Mirrored's ``(model, optimizer)`` without DDP; the optimizer's updates are this replica's own."""
        wrapped, prepared = super().prepare(model, optimizer, compile=compile)
        if optimizer is None:
            return wrapped, prepared
        n, updates = self.num_replicas_in_sync, [0]
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def own_mean_gradient(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            # compute_average_loss divided by the global batch: n times that is this replica's share's mean.
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(n)

        def average(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            updates[0] += 1
            if updates[0] % self.sync_every == 0:
                with torch.no_grad():
                    for p in params:
                        dist.all_reduce(p.data)
                        p.data.div_(n)

        optimizer.register_step_pre_hook(own_mean_gradient)
        optimizer.register_step_post_hook(average)
        return wrapped, prepared


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(EXAMPLES, 6, generator=g), torch.randint(0, 3, (EXAMPLES,), generator=g)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    return net, torch.optim.SGD(net.parameters(), lr=LR)


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _plain_loop(strategy: towers.Strategy) -> list[dict[str, torch.Tensor]]:
    """The user's loop without strategy.run; the parameters after each update."""
    net, optimizer = strategy.prepare(*_model())
    after = []
    for _ in range(EPOCHS):
        for x, y in strategy.distribute_dataset(_data(), GLOBAL_BATCH, shuffle=False):
            towers.compute_average_loss(F.cross_entropy(net(x), y, reduction="none")).backward()
            optimizer.step()
            optimizer.zero_grad()
            after.append(_state(net))
    return after


def _replica() -> dict[str, Any]:
    # Registered in the job's processes only: a registration in the test process would outlive this test (a
    # strategy taking **options "takes" every option, which other tests of strategy_from_env check against).
    register_strategy("local_sgd", LocalSGDStrategy)
    every_step = towers.get_strategy("local_sgd", sync_every=1)
    every_third = towers.get_strategy("local_sgd", sync_every=3)
    net, optimizer = _model()
    trainer = towers.Trainer(net, optimizer, loss=F.cross_entropy, strategy=towers.get_strategy("local_sgd"))
    trainer.fit(torch.utils.data.TensorDataset(*_data()), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, shuffle=False)
    return {"k1": _plain_loop(every_step), "k3": _plain_loop(every_third), "fit": _state(net)}


def _one_device() -> dict[str, torch.Tensor]:
    """Plain torch: SGD on each whole global batch, in order."""
    net, optimizer = _model()
    x, y = _data()
    for _ in range(EPOCHS):
        for start in range(0, EXAMPLES, GLOBAL_BATCH):
            F.cross_entropy(net(x[start:start + GLOBAL_BATCH]), y[start:start + GLOBAL_BATCH]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return _state(net)


def test_local_sgd_added_from_outside_towers() -> None:
    ranks = towers.spawn(_replica, 2, timeout_s=90)
    reference = _one_device()
    steps = EPOCHS * EXAMPLES // GLOBAL_BATCH
    for result in ranks:
        for key, value in reference.items():  # k=1: one device's maths, in a plain loop and in Trainer.fit
            torch.testing.assert_close(result["k1"][-1][key], value, rtol=0, atol=ATOL)
            torch.testing.assert_close(result["fit"][key], value, rtol=0, atol=ATOL)
        assert len(result["k1"]) == len(result["k3"]) == steps
        assert max(float((result["k3"][-1][k] - v).abs().max()) for k, v in reference.items()) > 100 * ATOL
    for step in range(steps):  # k=3: replicas bitwise equal after each averaging step, apart between them
        equal = [torch.equal(ranks[0]["k3"][step][k], ranks[1]["k3"][step][k]) for k in reference]
        assert all(equal) if (step + 1) % 3 == 0 else not any(equal), (step, equal)
