"""Manual gradient accumulation, as torch code writes it, trains one device's update at 3 replicas.

k = 2 batches from ``distribute_dataset`` per update, ``(compute_average_loss(...) / k).backward()`` on each,
one ``optimizer.step()``, in a plain loop (no ``strategy.run``), in three spellings: no ``no_sync`` (every
backward all-reduces), DDP's ``with model.no_sync():`` on the first batch, and nanoGPT's
``model.require_backward_grad_sync = last`` ; then torch's own ``clip_grad_norm_`` after the window. Under
MirroredStrategy's SUM all-reduce the first spelling counted the first batch 3 times (at 2 replicas: 35%
off one device, in silence). One spawn of 3 processes; the reference is the plain one-device loop.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers

pytestmark = pytest.mark.timeout(180)

ROWS, BATCH, K, CLIP = 48, 6, 2, 0.3
SPELLINGS = ("every backward syncs", "no_sync", "require_backward_grad_sync")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(ROWS, 5, generator=g), torch.randint(0, 3, (ROWS,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3))


def _plain(clip: bool) -> list[torch.Tensor]:
    model, (x, y) = _model(), _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    for i, start in enumerate(range(0, ROWS, BATCH)):
        (F.cross_entropy(model(x[start:start + BATCH]), y[start:start + BATCH]) / K).backward()
        if i % K == K - 1:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _job() -> dict:
    strategy = towers.MirroredStrategy(timeout_s=60)
    out = {}
    for spelling in SPELLINGS:
        for clip in (False, True):
            with strategy.scope():
                net = _model()
                optimizer = torch.optim.SGD(net.parameters(), lr=0.4, momentum=0.9)
            model, optimizer = strategy.prepare(net, optimizer)
            for i, (xb, yb) in enumerate(strategy.distribute_dataset(_data(), BATCH, shuffle=False)):
                last = i % K == K - 1
                quiet = model.no_sync() if spelling == "no_sync" and not last else contextlib.nullcontext()
                if spelling == "require_backward_grad_sync":
                    model.require_backward_grad_sync = last
                with quiet:
                    (towers.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none")) / K).backward()
                if last:
                    if clip:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                    optimizer.step()
                    optimizer.zero_grad()
            out[(spelling, clip)] = [p.detach().clone() for p in strategy.unwrap(model).parameters()]
    return out


def test_manual_accumulation_trains_one_devices_update_at_three_replicas() -> None:
    ranks = towers.spawn(_job, 3, timeout_s=150)
    for clip in (False, True):
        want = _plain(clip)
        for spelling in SPELLINGS:
            for rank, got in enumerate(ranks):
                for a, b in zip(got[(spelling, clip)], want):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                               msg=lambda m, s=spelling, r=rank, c=clip: f"{s}, clip={c}, rank {r}: {m}")
