"""The seed CNN on the bundled digits with Adam, under bitwise=True (or not): what tests/distributed/test_bitwise.py runs
at 1, 2, 3 and 4 processes, through towers.spawn, and as a script under `towers launch --bitwise`.

As a script: ``python bitwise_job.py OUT_DIR [UPDATES [CHECKPOINTS DIE_AT]]`` trains with
``towers.strategy_from_env()`` and writes the chief's parameters, optimizer state and logged losses to
``OUT_DIR/result.pt``; with a checkpoint directory it saves every 10 updates and replica 1 dies after update DIE_AT
in the launcher's first attempt.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

import towers
from towers.datasets import load_digits
from towers.models import SeedCNN

GLOBAL_BATCH = 48
MICRO_BATCH = 4


def classifier_step(strategy: towers.Strategy, model: torch.nn.Module, optimizer: Any,
                    clip: str = "none") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The custom loop's step for a classifier: the global-batch cross entropy, backward, an optional clip
    (``"towers"``: ``strategy.clip_grad_norm_``; ``"torch"``: torch's own, a habit), the update; returns the loss."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        if clip == "towers":
            strategy.clip_grad_norm_(model.parameters(), 1.0)
        elif clip == "torch":  # a habit: torch's own clip on the prepared model's parameters
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    return step


def run_updates(strategy: towers.Strategy, step: Callable[..., torch.Tensor], batches: Any, updates: int) -> list[float]:
    """Run ``step`` through ``strategy.run`` on ``batches`` (epoch after epoch) for ``updates`` updates; return the
    losses the loop logs (``strategy.reduce("sum", ...)``)."""
    losses: list[float] = []
    while len(losses) < updates:
        for batch in batches:
            losses.append(strategy.reduce("sum", strategy.run(step, args=tuple(batch))).item())
            if len(losses) == updates:
                break
    return losses


def _outcome(strategy: towers.Strategy, model: torch.nn.Module, optimizer: Any, losses: list[float]) -> dict:
    """What a run ends with, to compare bit for bit: parameters, optimizer state, logged losses; the strategy shut."""
    raw = getattr(optimizer, "optimizer", optimizer)
    if isinstance(strategy, towers.ParameterServerStrategy):  # the state lives on the ps task: fetched
        raw = type("Fetched", (), {"state": dict(sorted(optimizer.state_dict()["state"].items()))})  # in param order

    def whole(v: torch.Tensor) -> torch.Tensor:  # a sharded strategy's DTensor gathered whole (a collective)
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()

    result = {"params": {k: whole(v) for k, v in strategy.unwrap(model).state_dict().items()},
              "optimizer": {i: {k: whole(v) for k, v in s.items() if torch.is_tensor(v)}
                            for i, s in enumerate(raw.state.values())},
              "losses": losses, "replicas": strategy.num_replicas_in_sync}
    if hasattr(strategy, "shutdown"):
        strategy.shutdown()
    return result


def _strategy(bitwise: bool, kind: str = "mirrored", **options: Any) -> towers.Strategy:
    """One device in one process; else ``kind``: ``"mirrored"``, ``"sharded"`` (FSDP2) or ``"ps"``, ``"hybrid"``
    (sync, the last rank a ps task) or ``"ps2"`` (sync, the last two ranks ps tasks, the parameters split over them)."""
    micro = MICRO_BATCH if bitwise else None
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return towers.OneDeviceStrategy("cpu", bitwise=bitwise, micro_batch_size=micro, **options)
    if kind == "sharded":
        return towers.FullyShardedStrategy(bitwise=bitwise, micro_batch_size=micro, **options)
    if kind in ("ps", "ps2", "hybrid"):  # the last rank(s) ps tasks: they serve until the workers are done, then return
        cls = towers.HybridStrategy if kind == "hybrid" else towers.ParameterServerStrategy
        return cls(num_ps=2 if kind == "ps2" else 1, mode="sync", bitwise=bitwise, micro_batch_size=micro,
                   exit_on_ps=False, timeout_s=60, **options)
    return towers.MirroredStrategy(bitwise=bitwise, micro_batch_size=micro, **options)


def train(updates: int, *, bitwise: bool = True, clip: str = "towers", strategy: towers.Strategy | None = None,
          checkpoints: str | None = None, stop_at: int | None = None, kind: str = "mirrored") -> dict:
    """Train ``updates`` updates; return the parameters, the optimizer state and the losses the loop logged.

    ``checkpoints``: a directory to resume from (the latest checkpoint there, if any) and, with ``stop_at``, to save
    in after that many updates and stop (a preemption), whatever the replica count of either run."""
    from towers.checkpoint import CheckpointManager

    strategy = strategy or _strategy(bitwise, kind)
    if getattr(strategy, "is_ps", False):
        return {}  # a ps task: its part is done
    torch.manual_seed(1234 + strategy.replica_id)  # different seeds per replica: prepare gives every one the chief's
    train_set, _ = load_digits()
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(train_set, GLOBAL_BATCH, shuffle=True, seed=7, drop_remainder=True)
    step = classifier_step(strategy, model, optimizer, clip=clip)
    if checkpoints is None:
        return _outcome(strategy, model, optimizer, run_updates(strategy, step, batches, updates))
    manager = CheckpointManager(checkpoints, strategy=strategy)
    losses: list[float] = []
    if manager.latest_checkpoint is not None:
        losses = list(manager.restore({"model": model, "optimizer": optimizer, "data": batches})["losses"])
    resumed_at = len(losses)
    losses += run_updates(strategy, step, batches, (stop_at or updates) - len(losses))
    if stop_at is not None:
        manager.save({"model": model, "optimizer": optimizer, "data": batches, "losses": losses})
    manager.close()
    return {**_outcome(strategy, model, optimizer, losses), "resumed_at": resumed_at}


def train_saving(updates: int, checkpoints: str, *, save_every: int, die_at: int | None = None) -> dict:
    """``train`` (no clip) under ``towers.strategy_from_env()``, resuming from the latest checkpoint in ``checkpoints``
    and saving every ``save_every`` updates; replica 1 dies (``os._exit``, no goodbye: the OOM killer's way) after
    update ``die_at``."""
    from towers.checkpoint import CheckpointManager

    strategy = towers.strategy_from_env()
    if getattr(strategy, "is_ps", False):
        return {}
    torch.manual_seed(1234 + strategy.replica_id)
    model = SeedCNN()
    model, optimizer = strategy.prepare(model, torch.optim.Adam(model.parameters(), lr=3e-3))
    batches = strategy.distribute_dataset(load_digits()[0], GLOBAL_BATCH, shuffle=True, seed=7, drop_remainder=True)
    step = classifier_step(strategy, model, optimizer, clip="none")
    manager = CheckpointManager(checkpoints, strategy=strategy)
    state = {"model": model, "optimizer": optimizer, "data": batches}
    losses = list(manager.restore(state)["losses"]) if manager.latest_checkpoint is not None else []
    resumed_at = len(losses)
    feed = (batch for _ in iter(int, 1) for batch in batches)  # epoch after epoch, one iterator throughout
    while len(losses) < updates:
        losses.append(strategy.reduce("sum", strategy.run(step, args=tuple(next(feed)))).item())
        if len(losses) % save_every == 0:
            manager.save({**state, "losses": losses})
        if len(losses) == die_at and strategy.replica_id == 1:
            os._exit(3)
    manager.close()
    return {**_outcome(strategy, model, optimizer, losses), "resumed_at": resumed_at}


def train_gpt(updates: int, kind: str = "mirrored", clip: bool = True, bucket_bytes: int | None = None) -> dict:
    """towers' GPT with AdamW, right-padded rows and a token mask (``compute_average_loss(per_token, weights=mask)``);
    under ``kind="sharded"`` each block is an FSDP2 unit of its own. ``bucket_bytes``: the replicas' exchange in buckets
    of that many bytes (default 25 MiB: one bucket for this model)."""
    if bucket_bytes is not None:
        import towers.strategies._bitwise_buckets as buckets

        buckets.BUCKET_BYTES = bucket_bytes
    from torch.utils.data import TensorDataset

    from towers.models_gpt import GPT, GPTConfig, random_tokens

    strategy = _strategy(True, kind)
    if getattr(strategy, "is_ps", False):
        return {}
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    x, y = random_tokens(96, config, seed=1)
    mask = (torch.arange(16)[None, :] < torch.randint(4, 17, (96, 1))).float()  # each row's real tokens
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(TensorDataset(x, y, mask), 24, shuffle=True, seed=3, drop_remainder=True)

    def step(tokens: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        per_token = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="none")
        loss = towers.compute_average_loss(per_token.view_as(weights), weights=weights)
        loss.backward()
        if clip:  # (the parameter servers refuse a global-norm clip: a worker holds its share)
            strategy.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    return _outcome(strategy, model, optimizer, run_updates(strategy, step, batches, updates))


def train_dropout(updates: int) -> dict:
    """An MLP with dropout on the digits, Adam: its masks are keyed by the micro-batch, not the replica."""
    strategy = _strategy(True)
    torch.manual_seed(7 + strategy.replica_id)  # each replica's own stream: the masks must not come from it
    train_set, _ = load_digits(size=8)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                    torch.nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(train_set, GLOBAL_BATCH, shuffle=True, seed=5, drop_remainder=True)

    return _outcome(strategy, model, optimizer,
                    run_updates(strategy, classifier_step(strategy, model, optimizer), batches, updates))


def train_habits(epochs: int, kind: str = "mirrored") -> dict:
    """The seed CNN with Adam on 149 digits, global batch 48 (an epoch ends on a batch of 5: two micro-batches, so at 3
    replicas one share is empty): once with ``gradient_accumulation_steps=2`` (an update window cut short by the epoch's
    end), once with accumulation by hand (the loop steps and zeroes every second batch); a weight decay term through
    ``scale_regularization_loss`` in both (not under ``kind="sharded"``). Both outcomes, by name."""
    return {name: _habit(epochs, kind, accumulation) for name, accumulation in (("accumulate", 2), ("by_hand", 1))}


def _habit(epochs: int, kind: str, accumulation: int) -> dict:
    strategy = _strategy(True, kind, gradient_accumulation_steps=accumulation)
    torch.manual_seed(1234 + strategy.replica_id)
    train_set, _ = load_digits()
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(torch.utils.data.Subset(train_set, range(149)), GLOBAL_BATCH, seed=3)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if accumulation > 1:
            optimizer.zero_grad()
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        # (under FSDP2 the parameters outside its forward are shards: a term over them is not the model's)
        decay = 0.0 if kind == "sharded" else towers.scale_regularization_loss(
            1e-3 * sum(p.square().sum() for p in model.parameters()))
        (loss + decay if accumulation > 1 else (loss + decay) / 2).backward()
        if accumulation > 1:
            optimizer.step()
        return loss

    losses: list[float] = []
    for _ in range(epochs):
        for i, batch in enumerate(batches):
            losses.append(strategy.reduce("sum", strategy.run(step, args=tuple(batch))).item())
            if accumulation == 1 and (i % 2 or i == len(batches) - 1):  # by hand: every second batch, and the last
                optimizer.step()
                optimizer.zero_grad()
    return _outcome(strategy, model, optimizer, losses)


def fit(epochs: int, kind: str = "mirrored") -> dict:
    """``Trainer.fit`` on the seed CNN (Adam, a global-norm clip but under ``kind="ps"``, accuracy): its parameters
    and logged history."""
    strategy = _strategy(True, kind)
    if getattr(strategy, "is_ps", False):
        return {}
    torch.manual_seed(1234 + strategy.replica_id)
    train_set, _ = load_digits()
    subset = torch.utils.data.Subset(train_set, range(480))
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    trainer = towers.Trainer(model, optimizer, loss=F.cross_entropy, strategy=strategy,
                             clip_grad_norm=None if kind == "ps" else 1.0, metrics=["accuracy"])
    history = trainer.fit(subset, epochs=epochs, global_batch_size=GLOBAL_BATCH)
    result = {"params": {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()},
              "loss": history["loss"], "accuracy": history["accuracy"], "replicas": strategy.num_replicas_in_sync}
    if hasattr(strategy, "shutdown"):
        strategy.shutdown()
    return result


if __name__ == "__main__":
    out_dir = sys.argv[1]
    if len(sys.argv) > 3:  # OUT_DIR UPDATES CHECKPOINTS DIE_AT: saving every 10 updates; replica 1 dies once
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        outcome = train_saving(int(sys.argv[2]), sys.argv[3], save_every=10,
                               die_at=int(sys.argv[4]) if first_attempt else None)
    else:
        outcome = train(int(sys.argv[2]) if len(sys.argv) > 2 else 10, strategy=towers.strategy_from_env())
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(outcome, os.path.join(out_dir, "result.pt"))


def bucketed_exchange(bucket_bytes: int) -> list[torch.Tensor]:
    """``BucketedExchange`` over this job's processes with buckets of ``bucket_bytes``: 7 leaves of random gradients of
    four parameters (the same on every rank), each rank's share of them, its parameters' last leaf done in an order of
    its own (shuffled by rank); returns the tree's sum of every parameter, to compare with one process's."""
    import random

    import torch.distributed as dist

    from towers.process_group import init_process_group
    from towers.strategies._bitwise_buckets import BucketedExchange
    from towers.cluster import from_env
    from towers.data import shard_bounds

    info = from_env()
    init_process_group(info, backend="gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((5, 3), (7,), (2, 2, 3), (11,))]
    torch.manual_seed(0)
    leaves = [[torch.randn(p.shape) * 10 ** float(torch.randint(-3, 3, ())) for p in params] for _ in range(7)]
    ranges = [shard_bounds(7, n, r) for r in range(n)]
    first, end = ranges[rank]
    exchange = BucketedExchange(params, n, bucket_bytes=bucket_bytes)
    exchange.begin(ranges, rank)

    def known(i: int) -> dict:
        return {(0, leaf): leaves[leaf][i] for leaf in range(first, end)}

    order = list(range(len(params)))
    random.Random(rank).shuffle(order)
    for i in order[:2]:  # two parameters done during the "backward", the rest at its end
        exchange.ready(i, known)
    totals = exchange.finish(known)
    dist.destroy_process_group()
    return totals
