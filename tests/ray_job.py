"""The README's training script and a resumable loop, run by tests/distributed/test_ray.py in Ray Train's workers
and under ``towers launch``.

    towers launch --nproc-per-node N --strategy S ray_job.py readme|resumable|fit OUT [--ckpt DIR]

In Ray, ``ray_entry`` (wrapped by ``towers.ray.train_loop``) builds the strategy the way a user writes it in a
``train_loop_per_worker`` and runs the same functions. Every run exports its final weights to OUT (a
``weights_only`` torch file) with ``strategy.export_model``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import towers
from towers.checkpoint import CheckpointManager, restore_checkpoint
from towers.datasets import load_digits
from towers.models import SeedCNN

EPOCHS = 2


def readme(strategy: Any, out: str) -> None:
    """The README's ``train.py`` block (2 epochs), then the weights to ``out``."""
    train_set, test_set = load_digits()
    torch.manual_seed(0)
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = strategy.prepare(model, optimizer)

    def loss_fn(logits, y):
        return towers.compute_average_loss(F.cross_entropy(logits, y, reduction="none"))

    def step(x, y):
        loss, _ = strategy.forward_backward(model, x, y, loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for epoch in range(EPOCHS):
        for x, y in strategy.distribute_dataset(train_set, global_batch_size=64, seed=epoch):
            loss = strategy.reduce("sum", strategy.run(step, args=(x, y)))
        if strategy.is_chief:
            print(f"epoch {epoch + 1}: last step's loss {loss.item():.5f}")
    strategy.export_model(model, out)


def resumable(strategy: Any, out: str, ckpt: str, *, ray: bool = False, kill_marker: str | None = None) -> None:
    """docs/checkpoints.md's loop on the digits: a checkpoint every 5 steps (reported to Ray under Ray), resumed
    from Ray's latest checkpoint (or the manager's). With ``kill_marker``, rank 1 dies at step 12 the first time."""
    train_set, _ = load_digits()
    torch.manual_seed(0)
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    model, optimizer = strategy.prepare(model, optimizer)
    batches = strategy.distribute_dataset(train_set, global_batch_size=64, shuffle=True, seed=0)
    objects = {"model": model, "optimizer": optimizer, "data": batches}
    manager = CheckpointManager(ckpt, strategy=strategy, max_to_keep=2)
    if ray:
        latest = towers.ray.latest_checkpoint()
        state = restore_checkpoint(latest, objects, strategy=strategy) if latest is not None else None
    else:
        state = manager.restore(objects)
    step = state["step"] if state else 0
    if strategy.is_chief:  # where each attempt started, for the test
        with open(f"{out}.starts", "a", encoding="utf-8") as fh:
            fh.write(f"{step}\n")

    def train_step(x, y):
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    while batches.epoch < EPOCHS:
        for x, y in batches:
            loss = strategy.reduce("sum", strategy.run(train_step, args=(x, y)))
            step += 1
            if kill_marker and step == 12 and strategy.replica_id == 1 and not os.path.exists(kill_marker):
                Path(kill_marker).write_text("killed")
                os._exit(1)  # a worker lost mid-epoch, with no goodbye
            if step % 5 == 0:
                path = manager.save({**objects, "step": step}, checkpoint_number=step)
                if ray:
                    towers.ray.report({"step": step, "loss": loss}, checkpoint=path)
    manager.close()
    strategy.export_model(model, out)


class _KillOnce(towers.callbacks.Callback):
    """Rank 1 dies (os._exit) at global step 40, in the second epoch, the first time."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def on_train_batch_end(self, batch, logs=None):
        strategy = self.trainer.strategy
        if strategy.replica_id == 1 and self.trainer.progress.global_step == 40 and not os.path.exists(self.marker):
            Path(self.marker).write_text("killed")
            time.sleep(3)
            os._exit(1)


class _NoteStart(towers.callbacks.Callback):
    """The chief notes the global step each attempt started at (after ``BackupAndRestore`` restored), for the test."""

    def __init__(self, backup: Any, path: str):
        super().__init__()
        self.backup, self.path = backup, path

    def on_train_begin(self, logs=None):
        if self.trainer.strategy.is_chief:
            start = self.backup.restored_from["global_step"] if self.backup.restored_from else 0
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(f"{start}\n")


class _StopAt(towers.callbacks.Callback):
    """Every replica asks to stop from global step ``step`` on: the job ends there, as one whose allocation ran out."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.progress.global_step >= self.step:
            self.trainer.stop_training = True


def fit(strategy: Any, out: str, *, ray: bool = False, kill_marker: str | None = None, backup_dir: str | None = None,
        stop_at: int | None = None, epochs: int = EPOCHS) -> None:
    """The README loop's ``Trainer.fit`` twin (examples/fit.py's model and data), backed up each epoch; under Ray
    ``RayReport`` reports each epoch's logs with the backup as the checkpoint. With ``backup_dir``, the backup goes
    there every 5 steps (a later run resumes from it); with ``stop_at``, the run stops at that global step."""
    train_set, test_set = load_digits()
    torch.manual_seed(0)
    with strategy.scope():
        model = SeedCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    trainer = towers.Trainer(model, optimizer, loss=F.cross_entropy, metrics=["accuracy"], strategy=strategy)
    # Under Ray with a kill, the restarted group backs up to a fresh folder: it resumes from Ray's checkpoint.
    attempt = 2 if kill_marker and os.path.exists(kill_marker) else 1
    backup = towers.callbacks.BackupAndRestore(backup_dir or f"{out}.backup{attempt}", delete_checkpoint=False,
                                               **({"save_freq": 5} if backup_dir else {}))
    callbacks = [backup, towers.ray.RayReport(backup)] if ray else [backup]
    if stop_at is not None:
        callbacks.append(_StopAt(stop_at))
    if kill_marker:
        callbacks.append(_KillOnce(kill_marker))
        callbacks.append(_NoteStart(backup, f"{out}.starts"))
    trainer.fit(train_set, epochs=epochs, global_batch_size=64, validation_data=test_set, callbacks=callbacks)
    strategy.export_model(trainer.model, out)


def build(name: str) -> Any:
    """The strategy as a user builds it inside ``train_loop_per_worker``."""
    if name == "mirrored":
        return towers.MirroredStrategy()
    if name == "sharded":
        return towers.FullyShardedStrategy()
    if name == "ps":
        return towers.ParameterServerStrategy(num_ps=1, mode="sync")
    if name == "hybrid":
        return towers.HybridStrategy(num_ps=1, mode="sync")
    return towers.strategy_from_env()


_TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN"}


def _address(field: str) -> str:
    """``/proc/net/tcp``'s ``HEX_IP:HEX_PORT`` as ``ip``: IPv4 one little-endian word, IPv6 four."""
    import ipaddress

    raw = bytes.fromhex(field.split(":")[0])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def tcp_sockets() -> list[list[str]]:
    """This process's TCP sockets that are connected or listening, as ``[state, local ip, remote ip]`` (from /proc: the
    socket inodes among its file descriptors, looked up in its network namespace's tables)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] in _TCP_STATES:
                found.append([_TCP_STATES[fields[3]], _address(fields[1]), _address(fields[2])])
    return found


def ray_entry(config: dict) -> None:
    """``train_loop_per_worker``: ``config`` = job, strategy, out (and ckpt, kill_marker, backup_dir, stop_at, epochs, env: the
    variables a user passes to the workers with ``ray.init(runtime_env={"env_vars": ...})``, e.g. ``TOWERS_STRATEGY``;
    sockets: a path prefix where each worker writes the TCP sockets it holds before and after the job, as JSON)."""
    os.environ.update(config.get("env", {}))
    before = tcp_sockets() if config.get("sockets") else []
    _run_entry(config)
    if config.get("sockets"):
        import json

        rank = int(os.environ.get("RANK", "0"))
        Path(f"{config['sockets']}.{rank}.json").write_text(json.dumps({"before": before, "after": tcp_sockets()}))


def _run_entry(config: dict) -> None:
    strategy = build(config["strategy"])
    if config["job"] == "readme":
        readme(strategy, config["out"])
    elif config["job"] == "resumable":
        resumable(strategy, config["out"], config["ckpt"], ray=True, kill_marker=config.get("kill_marker"))
    else:
        fit(strategy, config["out"], ray=True, kill_marker=config.get("kill_marker"), backup_dir=config.get("backup_dir"),
            stop_at=config.get("stop_at"), epochs=config.get("epochs", EPOCHS))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=("readme", "resumable", "fit"))
    parser.add_argument("out")
    parser.add_argument("--ckpt")
    args = parser.parse_args()
    strategy = towers.strategy_from_env()
    if args.job == "readme":
        readme(strategy, args.out)
    elif args.job == "resumable":
        resumable(strategy, args.out, args.ckpt)
    else:
        fit(strategy, args.out)


if __name__ == "__main__":
    main()
