"""One replica group of a FaultTolerantStrategy job, for the fault-tolerance test and benchmark.

    ft_job.py LIGHTHOUSE GROUP_ID STOP_FILE OUT_DIR [--peer-timeout-s S] [--seed N]

A custom loop over ``strategy.distribute_dataset``. After each committed step it prints
``step N groups G t T`` (T: time.time()). It stops after the step named in STOP_FILE (an integer
the test writes, atomically, once it has seen what it waits for: every group reads it well before
that step, so all stop after the same step) and writes its parameters to OUT_DIR/group<ID>.pt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import towers
from towers.cluster.info import ProcessInfo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lighthouse")
    parser.add_argument("group", type=int)
    parser.add_argument("stop_file")
    parser.add_argument("out")
    parser.add_argument("--peer-timeout-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    info = ProcessInfo(rank=args.group, world_size=2)  # one process per group; the group id is its rank
    strategy = towers.get_strategy("ft", info=info, lighthouse=args.lighthouse, peer_timeout_s=args.peer_timeout_s)
    torch.manual_seed(args.seed)  # a restarted group starts from other weights: healing must replace them
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    g = torch.Generator().manual_seed(123)
    x = torch.randn(512, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    batches = strategy.distribute_dataset(data, 32, seed=7)

    def step(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(features), labels, reduction="none")
        loss = towers.compute_average_loss(per_example)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    stop_at = None
    while stop_at is None or strategy.current_step < stop_at:
        for features, labels in batches:
            strategy.run(step, args=(features, labels))
            print(f"step {strategy.current_step} groups {strategy.num_replicas_in_sync} t {time.time():.4f}", flush=True)
            if stop_at is None and os.path.exists(args.stop_file):
                stop_at = int(Path(args.stop_file).read_text())
            if stop_at is not None and strategy.current_step >= stop_at:
                break
    # Collectives over the live groups, after the last step (every group reaches them).
    groups = strategy.all_gather_object(args.group)
    total = float(strategy.reduce("sum", 1.0))
    gathered = strategy.gather(torch.tensor([args.group] * (args.group + 1))).tolist()
    print(f"collectives groups={groups} sum={total} gathered={gathered}", flush=True)
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, Path(args.out) / f"group{args.group}.pt")
    print(f"done {strategy.current_step} not_committed {strategy.steps_not_committed}", flush=True)
    strategy.shutdown()
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads need no goodbye


if __name__ == "__main__":
    main()
