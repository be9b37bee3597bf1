"""One replica group of a FaultTolerantStrategy job that trains with ``Trainer.fit``, for tests/distributed/test_ft_trainer.py.

    ft_trainer_job.py LIGHTHOUSE GROUP_ID OUT_DIR [--peer-timeout-s S] [--seed N] [--epochs E]
                      [--hold-at STEP --gate FILE]

The same script as under any other strategy: ``Trainer(...).fit(dataset, epochs=E,
global_batch_size=32)``. It prints ``ready`` once the Trainer is built, then after each committed
step ``step S epoch E groups G`` (S: the job's global step). With ``--hold-at`` it waits after
global step STEP until FILE exists (the test writes it once the group it waits for is back), so
the job cannot end before then. At the end it writes its parameters to OUT_DIR/group<ID>.pt, its
optimizer's state by parameter name to OUT_DIR/group<ID>.optimizer.pt and its History and progress
to OUT_DIR/group<ID>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import towers
from ft_support import end_job
from towers.cluster.info import ProcessInfo

NUM_EXAMPLES = 500  # 16 global batches of 32 per epoch, the last one of 20
GLOBAL_BATCH_SIZE = 32


def dataset() -> torch.utils.data.TensorDataset:
    """The job's data (the test builds the same for its one-device reference)."""
    x = torch.randn(NUM_EXAMPLES, 8, generator=torch.Generator().manual_seed(123))
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The job's model and optimizer, from ``seed``'s initial weights."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


class Report(towers.callbacks.Callback):
    """Print each committed step; hold after global step ``hold_at`` until ``gate`` exists."""

    def __init__(self, hold_at: int | None, gate: str | None) -> None:
        super().__init__()
        self.hold_at, self.gate = hold_at, gate

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = int((logs or {})["global_step"])
        strategy = self.trainer.strategy
        print(f"step {step} epoch {self.trainer.progress.epoch} groups {strategy.live_replicas}", flush=True)
        if step == self.hold_at and self.gate is not None:
            print(f"holding at {step}", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate):  # the test opens it on an event it saw, never on a timer
                if time.monotonic() > deadline:
                    raise SystemExit(f"group {strategy.replica_group_id}: {self.gate} not written within 60 s")
                time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lighthouse")
    parser.add_argument("group", type=int)
    parser.add_argument("out")
    parser.add_argument("--peer-timeout-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--gate", default=None)
    parser.add_argument("--ledger", default=None, help="the run directory of the job's ledger")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")  # towers' warnings

    # one process per group; the group id is its rank
    info = ProcessInfo(rank=args.group, world_size=2, ledger_dir=args.ledger)
    strategy = towers.get_strategy("ft", info=info, lighthouse=args.lighthouse, peer_timeout_s=args.peer_timeout_s)
    net, optimizer = model_and_optimizer(args.seed)  # a restarted group starts from other weights: it must heal
    trainer = towers.Trainer(net, optimizer, loss=nn.functional.cross_entropy, metrics=["accuracy"],
                             strategy=strategy, log_every_n_steps=4)
    print("ready", flush=True)
    history = trainer.fit(dataset(), epochs=args.epochs, global_batch_size=GLOBAL_BATCH_SIZE,
                          callbacks=[Report(args.hold_at, args.gate)])
    out = Path(args.out)
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, out / f"group{args.group}.pt")
    names = {id(p): n for n, p in net.named_parameters()}  # the optimizer's state by parameter name (its momentum)
    torch.save({f"{names[id(p)]}.{key}": value for p, state in optimizer.state.items() for key, value in state.items()},
               out / f"group{args.group}.optimizer.pt")
    p = trainer.progress
    summary = {"epochs": history.epoch, "history": history.history, "global_step": p.global_step,
               "job_step": strategy.current_step, "not_committed": strategy.steps_not_committed}
    (out / f"group{args.group}.json").write_text(json.dumps(summary))
    print(f"done {json.dumps(summary)}", flush=True)
    end_job(strategy)


if __name__ == "__main__":
    main()
