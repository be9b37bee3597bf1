"""The job of tests/distributed/test_stuck.py: a tiny training loop whose rank 1 gets one fault.

Importable by name (tests/ is on the path), so the test's processes can be forked from a server
that imported torch once (``multiprocessing``'s forkserver): each job then starts in a fraction
of a second instead of paying torch's import in every process.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable

FAULT_STEP = 2  # rank 1's fault comes at this step (0-based) of 4: 2 epochs of 2 steps
FAULTS = ("stop", "loop", "skip", "extra_step")
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "towers", "towers.strategies"]


def run_rank(env: dict, strategy_name: str, fault: str, out_path: str, err_path: str) -> None:
    """Entry point of one rank: route stdout/stderr to files, take the job's variables, run the job."""
    run_as_script(env, out_path, err_path, _job, strategy_name, fault)


def run_as_script(env: dict, out_path: str, err_path: str, job: Callable[..., None], *args: Any) -> None:
    """Run ``job(*args)`` as one rank of a script: stdout/stderr to files, ``env`` set, one torch thread; exit
    like the interpreter does (1 after printing an uncaught exception, else 0)."""
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None  # the forkserver may have cached its own TMPDIR
    import torch

    torch.set_num_threads(1)
    try:
        job(*args)
    except BaseException:  # noqa: BLE001 - as the interpreter does for a script's uncaught exception
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def _spin_forever() -> None:
    """A Python loop that never ends: the rank's watchdog still answers."""
    n = 0
    while True:
        n += 1


def _job(strategy_name: str, fault: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import towers

    rank = int(os.environ["RANK"])
    if strategy_name == "ps":
        strategy = towers.ParameterServerStrategy(num_ps=1, mode="sync", timeout_s=120)  # a ps serves, then exits
    else:
        strategy = towers.MirroredStrategy(timeout_s=120)
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model, optimizer = strategy.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    faulty = rank == 1

    def announce() -> None:
        print(f"FAULT {time.time():.3f}", flush=True)

    def train_step() -> None:
        x = torch.randn(8, 4, generator=g)
        loss = towers.compute_average_loss(F.cross_entropy(model(x), (x[:, 0] > 0).long(), reduction="none"),
                                           global_batch_size=8 * strategy.num_replicas_in_sync)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        strategy.reduce("sum", loss.detach())

    step = 0
    for epoch in range(2):
        for _ in range(2):
            if faulty and step == FAULT_STEP and fault == "stop":
                announce()
                os.kill(os.getpid(), signal.SIGSTOP)
            if faulty and step == FAULT_STEP and fault == "loop":
                announce()
                _spin_forever()
            train_step()
            step += 1
        if faulty and epoch == 0 and fault == "skip":
            announce()  # e.g. a barrier inside an `if strategy.is_chief:` branch
            continue
        if faulty and epoch == 1 and fault == "extra_step":
            announce()
            train_step()
        strategy.barrier()
    print("DONE", flush=True)
