"""The job of tests/distributed/test_chief_only_result.py: TensorFlow's habit, ``print(metric.result())`` on the chief only.

A custom loop over ``strategy.distribute_dataset`` with a towers metric updated in the step; after the
first epoch (or after the loop) the chief alone calls ``result()`` (it prints ``CALL <time>`` first), the
other replicas go on to the next epoch's steps (or end). Importable by name (tests/ is on the path), so
the ranks fork from a server that imported torch once (see tests/stuck_job.py, whose ``run_as_script``
runs each rank as a script). Run as a script (``python chief_result_job.py epoch``), it is the job that
``towers launch --strategy fault_tolerant`` runs as two replica groups.
"""

from __future__ import annotations

import os
import time

import stuck_job

PRELOAD = stuck_job.PRELOAD


def run_rank(env: dict, out_path: str, err_path: str, when: str) -> None:
    """Entry point of one rank: stdout/stderr to files, the job's variables set, the job run as a script.

    ``when``: ``"epoch"``, the chief calls ``result()`` alone after the first epoch; ``"end"``, after the loop.
    """
    stuck_job.run_as_script(env, out_path, err_path, _script, when)


def _script(when: str) -> None:
    import atexit

    _job(when)
    atexit._run_exitfuncs()  # a script that ends runs its exit hooks (run_as_script then ends the process at once)


def _job(when: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import towers

    options = {"mode": "sync"} if os.environ["TOWERS_STRATEGY"] in ("ps", "hybrid") else {}
    strategy = towers.strategy_from_env(**options)  # a ps task serves here, then exits
    with strategy.scope():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        accuracy = towers.metrics.SparseCategoricalAccuracy()
    model, optimizer = strategy.prepare(net, optimizer)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x)
        strategy.backward(towers.compute_average_loss(F.cross_entropy(logits, y, reduction="none")))
        optimizer.step()
        optimizer.zero_grad()
        accuracy.update(logits, y)

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(96, 4, generator=g), torch.randint(0, 3, (96,), generator=g))
    for epoch in range(2):
        for batch in strategy.distribute_dataset(data, 8 * strategy.num_replicas_in_sync):
            strategy.run(step, args=batch)
        if strategy.is_chief and (when == "epoch" or epoch == 1):
            print(f"CALL {time.time():.3f}", flush=True)
            print(f"epoch {epoch}: accuracy {accuracy.result():.3f}", flush=True)  # the other replicas never call it
    print("DONE", flush=True)


if __name__ == "__main__":  # as a script under `towers launch` (the fault-tolerant case): chief_result_job.py epoch|end
    import sys

    _job(sys.argv[1] if len(sys.argv) > 1 else "epoch")  # later arguments mark the test's processes: ignored
