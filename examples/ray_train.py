"""The README's training loop on Ray Train: ``TorchTrainer`` starts the workers, towers trains on Ray's process group.

    python examples/ray_train.py                                   # 2 mirrored replicas on a local Ray cluster
    python examples/ray_train.py --strategy ps --workers 3         # 2 workers + 1 ps task, sync updates
    RAY_ADDRESS=head:6379 python examples/ray_train.py --workers 8 # an existing cluster

Each epoch's last loss reaches Ray with a towers checkpoint (``towers.ray.report``); a restarted worker group
(``FailureConfig(max_failures=...)``) resumes from ``ray.train.get_checkpoint()`` (``towers.ray.latest_checkpoint``).
Needs ``pip install 'towers[ray]'``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F

import towers
from towers.checkpoint import CheckpointManager, restore_checkpoint
from towers.datasets import load_digits
from towers.models import SeedCNN


def build_strategy(name: str) -> towers.Strategy:
    """The strategy, built inside each Ray worker on the process group Ray made."""
    if name == "ps":
        return towers.ParameterServerStrategy(num_ps=1, mode="sync")   # the last Ray worker is the ps task
    return towers.get_strategy(name)


def train_func(config: dict) -> None:
    """``train_loop_per_worker``: the README's loop, a checkpoint per epoch reported to Ray, resumed after a restart."""
    strategy = build_strategy(config["strategy"])
    train_set, _ = load_digits()
    torch.manual_seed(0)                           # the same initial weights on every replica
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(train_set, global_batch_size=64, shuffle=True, seed=0)
    objects = {"model": model, "optimizer": optimizer, "data": batches}
    latest = towers.ray.latest_checkpoint()       # None on the first attempt
    state = restore_checkpoint(latest, objects, strategy=strategy) if latest is not None else None
    epoch = state["epoch"] if state else 0
    manager = CheckpointManager(config["checkpoint_dir"], strategy=strategy, max_to_keep=2)

    def step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    while epoch < config["epochs"]:
        for x, y in batches:
            loss = strategy.reduce("sum", strategy.run(step, args=(x, y)))
        epoch += 1
        path = manager.save({**objects, "epoch": epoch}, checkpoint_number=epoch)
        towers.ray.report({"epoch": epoch, "loss": loss}, checkpoint=path)
    manager.close()


def main(argv: list[str] | None = None) -> dict:
    """Run ``train_func`` on Ray Train and return the last reported metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="mirrored", help="mirrored, sharded, ps, ... (default: mirrored)")
    parser.add_argument("--workers", type=int, default=2, help="Ray workers, ps tasks included (default: 2)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--storage", default=None, help="Ray's storage_path (default: a temporary folder)")
    args = parser.parse_args(argv)

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        ray.init(include_dashboard=False)           # a local cluster, or the one RAY_ADDRESS names
    storage = args.storage or tempfile.mkdtemp(prefix="towers-ray-storage-")
    trainer = TorchTrainer(
        towers.ray.train_loop(train_func),
        train_loop_config={"strategy": args.strategy, "epochs": args.epochs,
                           "checkpoint_dir": f"{storage}/towers-checkpoints"},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=torch.cuda.is_available()),
        run_config=RunConfig(storage_path=storage, failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    print(f"{args.workers} Ray worker(s), {args.strategy}: {result.metrics}")
    return dict(result.metrics or {})


if __name__ == "__main__":
    main()
