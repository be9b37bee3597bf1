"""``towers.plan.estimate_memory`` against the memory a real towers job holds, per rank, at 1, 2 and 4 CPU processes.

One spawn per world size (the pytest process itself for one) runs a short job (Adam, 3 steps)
under MirroredStrategy and then under FullyShardedStrategy and measures each rank's peak of
live tensor bytes: a ``TorchDispatchMode`` entered before the model is built keeps a weak
reference to the storage of every tensor any op returns (torch's own, DDP's buckets, FSDP2's
shards and gathered parameters, the optimizer's state) and sums their current sizes after every
op (FSDP2 frees gathered parameters by resizing their storages to 0, so sizes are read, not
remembered). That is what the allocator holds for tensors, measured on the real run; the
estimate counts shapes and traces fake tensors.
The estimate must be within 20% of the measured peak on every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.plan import estimate_memory_table

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from plan_accuracy import LiveTensorBytes  # noqa: E402  (the measurement the plan benchmark makes, shared)

pytestmark = pytest.mark.timeout(240)

SPAWN_TIMEOUT_S = 180
BATCH, STEPS, D_IN, CLASSES = 256, 3, 64, 10
TOLERANCE = 0.20


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """A stem, four repeated blocks (FSDP2 units under ``shard_units="auto"``) and a head."""

    def __init__(self, d: int = 128):
        super().__init__()
        self.stem = nn.Linear(D_IN, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _measure(strategy_name: str, info: ProcessInfo | None) -> int:
    """The user's loop, measured from before the model exists; returns the peak live tensor bytes of the steps."""
    tracker = LiveTensorBytes()
    with tracker:
        strategy = (towers.MirroredStrategy(info=info) if strategy_name == "mirrored"
                    else towers.FullyShardedStrategy(info=info))
        with strategy.scope():
            model = build()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, optimizer = strategy.prepare(model, optimizer)
        n = strategy.num_replicas_in_sync
        g = torch.Generator().manual_seed(1)
        # The data set is made per step below, so only the current batch is live (the estimate counts one batch).
        tracker.peak = 0

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        for _ in range(STEPS):
            data = (torch.randn(BATCH * n, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH * n,), generator=g))
            for x, y in strategy.distribute_dataset(data, BATCH * n, shuffle=False):
                strategy.run(step, args=(x, y))
            del data
    return tracker.peak


def _replica(info: ProcessInfo | None = None) -> dict[str, int]:
    return {name: _measure(name, info) for name in ("mirrored", "sharded")}


def test_estimate_within_20_percent_of_measured_peak_per_rank():
    rows = []
    for world_size in (1, 2, 4):
        # One process needs no launch: it runs here, as a one-replica job does.
        measured = ([_replica(ProcessInfo())] if world_size == 1
                    else towers.spawn(_replica, world_size, timeout_s=SPAWN_TIMEOUT_S))
        for strategy in ("mirrored", "sharded"):
            (estimate,) = estimate_memory_table(build, replicas=[world_size], strategy=strategy, batch_size=BATCH,
                                                input_shape=(D_IN,), optimizer="adam")
            for rank, peaks in enumerate(measured):
                rows.append((strategy, world_size, rank, estimate.peak, peaks[strategy]))
    off = [r for r in rows if abs(r[3] - r[4]) > TOLERANCE * r[4]]
    table = "\n".join(f"{s} n={n} rank {r}: estimate {e / 2**20:.2f} MiB, measured {m / 2**20:.2f} MiB "
                      f"({(e - m) / m:+.1%})" for s, n, r, e, m in rows)
    assert not off, f"estimates more than {TOLERANCE:.0%} off:\n{table}"
    # Sharding really shrinks each rank's memory, in the measurement as in the estimate.
    peak = {(s, n): m for s, n, r, _, m in rows if r == 0}
    assert peak[("sharded", 4)] < peak[("sharded", 2)] < peak[("mirrored", 2)]
