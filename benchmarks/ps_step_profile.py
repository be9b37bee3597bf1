"""Where an async parameter-server step spends its time, on a worker and on the ps task.

One job (``towers.spawn``): 2 workers + 1 ps task, async, the seed CNN (or ``--params N`` in one
linear layer), batch 64 per worker, Adam or SGD. The phases are timed by wrapping towers' own
functions (nothing in the library changes): on a worker ``push_pull`` as a whole, its sends, its
receives (which include waiting for the ps), and the copy of the reply into the parameters; the
rest of ``push_pull`` is flattening gradients and building headers. On the ps task: receiving a
push, the optimizer's update, and sending the reply. Each phase is reported as wall and CPU
(thread) milliseconds per step, median over the timed steps, beside the worker's forward+backward.

    python benchmarks/ps_step_profile.py                          # seed CNN, Adam: shared memory, wire, overlap
    python benchmarks/ps_step_profile.py --params 10000000 --optimizer sgd
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

WARMUP, STEPS = 5, 40


class Phases:
    """Wall and CPU seconds per phase name, per step."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = collections.defaultdict(list)
        self.cpu: dict[str, list[float]] = collections.defaultdict(list)
        self.current: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase][0] += time.perf_counter() - w
                self.current[phase][1] += time.thread_time() - c

        setattr(owner, name, timed)

    def end_step(self, keep: bool) -> None:
        if keep:
            for phase, (w, c) in self.current.items():
                self.wall[phase].append(w * 1000)
                self.cpu[phase].append(c * 1000)
        self.current.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        return {p: {"wall_ms": statistics.median(self.wall[p]), "cpu_ms": statistics.median(self.cpu[p])}
                for p in self.wall}


def _job(params: int, optimizer_name: str, overlap: bool, shared: bool = True) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import towers
    from towers.models import SeedCNN
    from towers.strategies.parameter_server import server, worker
    from towers.strategies.parameter_server.transport import Link

    torch.set_num_threads(1)
    phases = Phases()
    # Installed in every process before the strategy starts: on the ps task (which serves inside the
    # constructor) Link.recv/send are its receiving of pushes and sending of replies.
    for owner, name, phase in ((Link, "send", "send"), (Link, "recv", "receive (incl. waiting)"),
                               (server.ParameterServer, "_step", "ps: optimizer update"),
                               (server.ParameterServer, "_to_shared", "ps: reply into shared memory"),
                               (worker.BoundModel, "push_pull", "push_pull (all)"),
                               (worker.BoundModel, "_to_params", "copy into parameters"),
                               (worker.BoundModel, "_staged", "copy into parameters")):
        phases.wrap(owner, name, phase)
    pushes = server.ParameterServer._push

    def push_then_count(self: Any, w: int, msg: Any) -> Any:  # the ps: one "step" per push handled
        try:
            return pushes(self, w, msg)
        finally:
            phases.end_step(keep=self.version > 2 * WARMUP)

    server.ParameterServer._push = push_then_count  # type: ignore[method-assign]
    strategy = towers.ParameterServerStrategy(num_ps=1, mode="async", overlap=overlap, timeout_s=120,
                                              exit_on_ps=False, shared_memory=shared)
    if strategy.is_ps:  # served until the workers were done
        return {"role": "ps", "phases": phases.summary()}
    phases.current.clear()
    torch.manual_seed(0)
    net = SeedCNN() if not params else nn.Linear(params // 10, 10, bias=False)
    optimizer = (torch.optim.Adam(net.parameters(), lr=1e-3) if optimizer_name == "adam"
                 else torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    model, opt = strategy.prepare(net, optimizer)
    g = torch.Generator().manual_seed(strategy.replica_id)
    shape = (64, 1, 28, 28) if not params else (64, params // 10)
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 10, (64,), generator=g)
    phases.wall.clear()
    phases.cpu.clear()
    for step in range(WARMUP + STEPS):
        w, c = time.perf_counter(), time.thread_time()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        phases.current["forward + backward"][0] += time.perf_counter() - w
        phases.current["forward + backward"][1] += time.thread_time() - c
        w0, c0 = time.perf_counter(), time.thread_time()
        opt.step()
        opt.zero_grad()
        phases.current["optimizer.step (all)"][0] += time.perf_counter() - w0
        phases.current["optimizer.step (all)"][1] += time.thread_time() - c0
        phases.end_step(step >= WARMUP)
    result = {"role": "worker", "phases": phases.summary()}
    strategy.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    """Profile the async step through shared memory, on the wire, and on the wire with overlap; print a table per
    setting (and JSON with --json-out)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=0, help="0: the seed CNN; else a linear layer of about N parameters")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    import towers

    out = {}
    for label, overlap, shared in (("shared memory", False, True), ("wire", False, False),
                                   ("wire, overlap", True, False)):
        per_rank = towers.spawn(_job, 3, args=(args.params, args.optimizer, overlap, shared), timeout_s=600,
                                threads_per_process=1, env={"TOWERS_NUM_PS": "1", "TOWERS_STRATEGY": "ps"})
        worker0, ps = per_rank[0], next(r for r in per_rank if r["role"] == "ps")
        out[label] = {"worker 0": worker0["phases"], "ps": ps["phases"]}
        print(f"\nasync, {label}, {'seed CNN' if not args.params else f'{args.params:,} params'}, "
              f"{args.optimizer}: ms per step on worker 0 and per push on the ps task (medians)")
        for who, table in (("worker 0", worker0["phases"]), ("ps task", ps["phases"])):
            for phase, v in sorted(table.items(), key=lambda kv: -kv[1]["wall_ms"]):
                print(f"  {who:9s} {phase:30s} wall {v['wall_ms']:7.2f}   cpu {v['cpu_ms']:7.2f}")
    print(f"1-minute load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
