"""A Trainer.fit job with BackupAndRestore, for the preemption tests (run under ``towers launch``).

    preempt_job.py OUT_DIR [--signal-self-at STEP --signal NAME --rank R] [--wait-at STEP]
                           [--signal-at ATTEMPT:STEP:RANK ...]

Each global step the chief prints ``step N`` (before the step's backup, so the step a preempted
attempt saved at is printed too), and at the start of training ``attempt A begins at global step
G`` (A: the launcher's restart count). ``--signal-self-at``: on the first attempt, rank R sends
itself the signal after that step (a SIGTERM/SIGUSR1 to one process). ``--signal-at``: on restart
ATTEMPT of this launch, rank RANK gets the signal after step STEP: a worker sends it to itself; a
ps task, which runs nothing of the script past the strategy, gets it from the chief (every process
writes its pid to OUT_DIR/pid-rankR first), which then waits until the notice reached the job.
``--wait-at``: on the first attempt, every rank waits after that step until a preemption notice
reached it (the test signals ``towers launch`` then). At the end the chief writes the parameters to
OUT_DIR/final.pt and prints where the backup resumed (``resumed at global step N`` or ``fresh start``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import towers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--signal-self-at", type=int, default=None)
    parser.add_argument("--signal", default="SIGUSR1")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--wait-at", type=int, default=None)
    parser.add_argument("--signal-at", action="append", default=[], metavar="ATTEMPT:STEP:RANK")
    args = parser.parse_args()
    out = Path(args.out)
    first_attempt = not (out / "signalled").exists()
    signal_at = [tuple(int(part) for part in spec.split(":")) for spec in args.signal_at]
    # Before the strategy: on a ps task the constructor serves until the workers are done.
    (out / f"pid-rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))

    strategy = towers.strategy_from_env(timeout_s=60)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = towers.Trainer(model, optimizer, F.cross_entropy, strategy=strategy)
    backup = towers.callbacks.BackupAndRestore(out / "backup", save_freq="epoch")
    rank, attempt = strategy.process_info.rank, strategy.process_info.restart_count
    sig = getattr(signal, args.signal)

    def wait_for_notice(reached) -> None:
        deadline = time.monotonic() + 60
        while not reached():  # the test (or the chief) signals
            if time.monotonic() > deadline:
                raise RuntimeError("no preemption notice arrived within 60 s")
            time.sleep(0.05)

    class Report(towers.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if strategy.is_chief:
                print(f"step {int(logs['global_step'])}", flush=True)

    class Drive(towers.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if strategy.is_chief:  # BackupAndRestore, before this callback, found the backup or none
                begin = backup.restored_from["global_step"] if backup.restored_from else 0
                print(f"attempt {attempt} begins at global step {begin}", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            step = int(logs["global_step"])
            for when, at, target in signal_at:
                if (when, at) != (attempt, step):
                    continue
                if target == rank:
                    os.kill(os.getpid(), sig)
                elif strategy.is_chief and target >= strategy.num_replicas_in_sync:  # a ps task
                    os.kill(int((out / f"pid-rank{target}").read_text()), sig)
                    wait_for_notice(lambda: backup.preemption is not None and backup.preemption.notice_given())
            if not first_attempt:
                return
            if args.signal_self_at == step and rank == args.rank:
                (out / "signalled").touch()
                os.kill(os.getpid(), sig)
            if args.wait_at == step:
                if strategy.is_chief:
                    (out / "signalled").touch()
                    print(f"waiting at step {step}", flush=True)
                wait_for_notice(lambda: backup.preemption is not None and backup.preemption.noticed is not None)

    trainer.fit((x, y), epochs=3, global_batch_size=16, callbacks=[Report(), backup, Drive()])
    if strategy.is_chief:
        torch.save([p.detach().clone() for p in trainer.unwrapped_model.parameters()], out / "final.pt")
        where = backup.restored_from
        print(f"resumed at global step {where['global_step']}" if where else "fresh start", flush=True)


if __name__ == "__main__":
    main()
