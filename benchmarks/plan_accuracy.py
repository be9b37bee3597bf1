"""``towers plan --mesh`` against the real job: estimated vs measured peak memory per rank, per parallel layout.

For each layout (``dp=2,tp=2`` and ``pp=2,dp=2`` by default) one spawn of 4 CPU processes runs
``FullyShardedStrategy(mesh=...)`` on towers' GPT (a few million parameters, Adam, a few steps
through ``strategy.forward_backward``: 1F1B with one micro-batch per stage under pp) and every rank
measures its peak of live tensor bytes the way ``tests/distributed/test_plan.py`` does: a
``TorchDispatchMode`` entered before the model is built keeps a weak reference to the storage of
every tensor any op returns (DTensor shards, FSDP2's gathered parameters, the pipeline's buffers,
the optimizer's state) and sums their current sizes after every op. (``tracemalloc`` does not see
torch's allocator.) The estimate is ``towers.plan.estimate_layout`` for the same model, mesh,
batch and optimizer, per rank; the script prints estimate / measured for each rank and layout.

    python benchmarks/plan_accuracy.py                       # both layouts (~1-2 min on 2 cores)
    python benchmarks/plan_accuracy.py --mesh dp=2,tp=2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import weakref
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

import towers
from towers.models_gpt import GPT, GPTConfig

#: ~5.3M parameters: 4 blocks of width 256 (4 heads), a vocabulary of 4,096, 64 tokens of context.
CONFIG = GPTConfig(vocab_size=4096, block_size=64, n_layer=4, n_head=4, n_embd=256)
BATCH, STEPS = 8, 3  # sequences per model replica per step
LAYOUTS = ("dp=2,tp=2", "pp=2,dp=2")
WORLD_SIZE = 4


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


class LiveTensorBytes(TorchDispatchMode):
    """The peak over ops of the summed current sizes of every storage an op returned that is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self._alive: dict[int, weakref.ref[Any]] = {}
        self.peak = 0

    def _storages(self, t: torch.Tensor) -> Iterator[Any]:
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local shard holds the memory
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    yield from self._storages(inner)
        else:
            yield t.untyped_storage()

    def live(self) -> int:
        return sum(s.nbytes() for s in (ref() for ref in list(self._alive.values())) if s is not None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in self._storages(t):
                    key = storage._cdata
                    if key not in self._alive:
                        self._alive[key] = weakref.ref(storage)
                        weakref.finalize(storage, self._alive.pop, key, None)
        self.peak = max(self.peak, self.live())
        return out


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).mean(1)


def measure(mesh: str) -> int:
    """One rank of the job on ``mesh``: the peak live tensor bytes of its training steps (after the first)."""
    torch.set_num_threads(1)
    tracker = LiveTensorBytes()
    with tracker:
        strategy = towers.FullyShardedStrategy(mesh=mesh)
        with strategy.scope():
            model = build()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, optimizer = strategy.prepare(model, optimizer)
        n = strategy.num_replicas_in_sync
        g = torch.Generator().manual_seed(1)

        def loss_fn(out: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return towers.compute_average_loss(_token_loss(out, yb))

        for step in range(STEPS):
            if step == 1:  # the first step makes the optimizer's state; the steady state is measured
                tracker.peak = 0
            x = torch.randint(0, CONFIG.vocab_size, (BATCH * n, CONFIG.block_size), generator=g)
            data = (x, torch.roll(x, -1, dims=1))
            for xb, yb in strategy.distribute_dataset(data, BATCH * n, shuffle=False):
                strategy.forward_backward(model, xb, yb, loss_fn)
                optimizer.step()
                optimizer.zero_grad()
            del data, x
    return tracker.peak


def estimate(mesh: str) -> list[int]:
    """The plan's peak per rank of ``mesh`` on ``WORLD_SIZE`` processes."""
    from towers.plan import estimate_layout

    est = estimate_layout(build, mesh=mesh, world_size=WORLD_SIZE, strategy="sharded", batch_size=BATCH,
                          seq_len=CONFIG.block_size, optimizer="adam")
    return [r.peak for r in est.per_rank()]


def run(meshes: tuple[str, ...] = LAYOUTS, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Measure and estimate each layout; one row per layout and rank."""
    rows = []
    for mesh in meshes:
        measured = towers.spawn(measure, WORLD_SIZE, args=(mesh,), timeout_s=timeout_s, threads_per_process=1)
        for rank, (m, e) in enumerate(zip(measured, estimate(mesh))):
            rows.append({"mesh": mesh, "rank": rank, "estimate": e, "measured": m, "ratio": e / m})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", action="append", help="a layout of 4 processes (repeatable; default: both)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(tuple(args.mesh or LAYOUTS))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"GPT {build().num_parameters():,} parameters, batch {BATCH} x {CONFIG.block_size} tokens per replica, "
          f"Adam, FullyShardedStrategy, {WORLD_SIZE} CPU processes (torch {torch.__version__}, {os.cpu_count()} CPUs)")
    print(f"{'mesh':<12} {'rank':>4} {'estimate':>12} {'measured':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['mesh']:<12} {r['rank']:>4} {r['estimate'] / 2**20:>8.2f} MiB {r['measured'] / 2**20:>8.2f} MiB "
              f"{r['ratio']:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
