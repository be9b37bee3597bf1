"""One replica group of a FaultTolerantStrategy job, for the fault-tolerance test and benchmark.

    ft_job.py LIGHTHOUSE GROUP_ID STOP_FILE OUT_DIR [--peer-timeout-s S] [--seed N]
    towers launch --strategy ft ... ft_job.py env - STOP_FILE OUT_DIR [--fail-group G --fail-at S --fail-how HOW]

A custom loop over ``strategy.distribute_dataset``. After each committed step it prints
``step N groups G t T`` (T: time.time()), and a group alone then pauses (``ALONE_PAUSE_S``).
Every 10 steps the processes agree (a ``reduce``) on whether STOP_FILE exists (the test creates
it once it has seen what it waits for); 10 steps after they first agree it does, every one of
them stops, at the same step, prints ``done N``, and writes its parameters to OUT_DIR/group<ID>.pt.

With LIGHTHOUSE ``env`` the strategy comes from ``towers launch`` (``towers.strategy_from_env()``),
and ``--fail-how kill|raise|stop`` makes process ``--fail-member`` of group ``--fail-group`` SIGKILL
itself, raise, or SIGSTOP itself before step ``--fail-at``, once (not after the launcher restarted
it: ``TOWERS_GROUP_RESTART``), right after printing ``failing (HOW) before step S t T``. A group of
several processes (``--group-size``) writes OUT_DIR/group<ID>.<PROCESS>.pt, one file per process.
Under ``towers launch`` process 0 of each group prints ``manager pid P at ADDRESS`` (its torchft
manager server), and process 0 of group 0, at its first step with both groups, ``listeners JSON``:
``[pid, address, port]`` of every listening socket of the job's processes (their command lines hold OUT_DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

import towers
from ft_support import end_job, listening_sockets
from towers.cluster.info import ProcessInfo
from towers.strategies import PeerLostError

#: A group that trains alone (the other one lost) pauses this long after each step. Hundreds of steps alone
#: prove nothing that the first few do not, and on a machine of 2 cores a survivor stepping flat out takes the
#: CPU from the group being started again (a group of 2 processes: back after about 12 s instead of 4.5 s).
ALONE_PAUSE_S = 0.05


def _say(line: str) -> None:
    """Print ``line`` in one write: the processes of a group share their stdout, and under ``python -u`` a
    ``print`` writes its text and its newline apart, so two processes' lines could merge into one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def one_device_reference(steps: int) -> dict[str, torch.Tensor]:
    """What this job computes on one device in ``steps`` steps (group 0's initial weights)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(123))
    y = (x[:, 0] > 0).long()
    for s in range(steps):
        epoch, index = divmod(s, 512 // 32)
        idx = torch.randperm(512, generator=torch.Generator().manual_seed(7 + epoch))[index * 32:(index + 1) * 32]
        (nn.functional.cross_entropy(net(x[idx]), y[idx], reduction="sum") / 32).backward()
        optimizer.step()
        optimizer.zero_grad()
    return net.state_dict()


def bitwise_reference(steps: int, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """What this job computes in ``steps`` steps under ``bitwise=True`` in one process: the bits a fault-tolerant job
    with the same micro-batches must end with, through lost and healed groups (group 0's initial weights)."""
    torch.set_num_threads(1)  # as every process of the job
    strategy = towers.OneDeviceStrategy("cpu", bitwise=True, micro_batch_size=micro_batch_size)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(123))
    batches = strategy.distribute_dataset(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), 32, seed=7)

    def step(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = towers.compute_average_loss(nn.functional.cross_entropy(model(features), labels, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    done = 0
    while done < steps:
        for features, labels in batches:
            strategy.run(step, args=(features, labels))
            done += 1
            if done == steps:
                break
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def done_step(output: str, processes: int) -> int:
    """The step every one of ``processes`` processes stopped after (their ``done N`` lines in ``output`` agree)."""
    steps = [int(line.split("done ", 1)[1].split()[0]) for line in output.splitlines() if "done " in line]
    assert len(steps) == processes and len(set(steps)) == 1, f"done lines {steps}, expected {processes} equal ones"
    return steps[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lighthouse")
    parser.add_argument("group", help="the replica group id (- under towers launch)")
    parser.add_argument("stop_file")
    parser.add_argument("out")
    parser.add_argument("--peer-timeout-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-group", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--fail-member", type=int, default=0)
    parser.add_argument("--fail-how", choices=("kill", "raise", "stop"), default="kill")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.lighthouse == "env":  # under towers launch --strategy ft: the group id is the rank
        strategy = towers.strategy_from_env()
        args.group = strategy.replica_group_id
        # Other initial weights per group, and after a restart, so that healing must replace them. A sharded group
        # heals process r from process r of a live group, and at step 0 those may be different groups: starting
        # from different weights, the job would start from a mix of them (valid, but not the reference's).
        first = 0 if getattr(strategy, "shard", False) else args.group
        args.seed = first + 10 * int(os.environ.get("TOWERS_GROUP_RESTART", "0"))
    else:
        args.group = int(args.group)
        info = ProcessInfo(rank=args.group, world_size=2)  # one process per group; the group id is its rank
        strategy = towers.get_strategy("ft", info=info, lighthouse=args.lighthouse,
                                       peer_timeout_s=args.peer_timeout_s)
    member, size = getattr(strategy, "group_rank", 0), getattr(strategy, "group_size", 1)
    if args.lighthouse == "env" and member == 0:  # where this group's torchft manager server listens
        _say(f"manager pid {os.getpid()} at {strategy.manager_address}")
    listed = args.lighthouse != "env" or args.group != 0 or member != 0  # group 0's process 0 lists the sockets
    fail = (args.fail_group == args.group and args.fail_member == member
            and os.environ.get("TOWERS_GROUP_RESTART", "0") == "0")
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
            if fail and strategy.current_step == args.fail_at:
                _say(f"failing ({args.fail_how}) before step {args.fail_at} t {time.time():.4f}")
                if args.fail_how == "raise":
                    raise RuntimeError(f"injected failure of replica group {args.group}")
                os.kill(os.getpid(), signal.SIGKILL if args.fail_how == "kill" else signal.SIGSTOP)
            strategy.run(step, args=(features, labels))
            groups = strategy.live_replicas // size
            _say(f"step {strategy.current_step} groups {groups} t {time.time():.4f}")
            if groups == 2 and not listed:  # both groups are up: every socket of the job is open
                _say(f"listeners {json.dumps(listening_sockets(args.out))}")
                listed = True
            if groups < 2:  # alone: yield the CPU to the group being restarted (see the docstring)
                time.sleep(ALONE_PAUSE_S)
            if stop_at is None and strategy.current_step % 10 == 0:  # every live process is at this step now
                try:  # the processes agree on whether the test asked them to stop, then stop 10 steps later
                    seen = float(strategy.reduce("max", 1.0 if os.path.exists(args.stop_file) else 0.0))
                except PeerLostError:  # a group lost since this step's quorum: ask again 10 steps later
                    seen = 0.0
                stop_at = strategy.current_step + 10 if seen else None
            if stop_at is not None and strategy.current_step >= stop_at:
                break
    # Collectives over the live groups, after the last step (every group reaches them).
    groups = strategy.all_gather_object(args.group)
    total = float(strategy.reduce("sum", 1.0))
    gathered = strategy.gather(torch.tensor([args.group] * (args.group + 1))).tolist()
    _say(f"collectives groups={groups} sum={total} gathered={gathered}")
    # A group that shards its model (shard=True) gathers the whole tensors: every process of the group takes part.
    torch.save({k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in net.state_dict().items()}, Path(args.out) / f"group{args.group}{f'.{member}' if size > 1 else ''}.pt")
    _say(f"done {strategy.current_step} not_committed {strategy.steps_not_committed}")
    end_job(strategy)


if __name__ == "__main__":
    main()
