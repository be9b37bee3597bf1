"""What handing batches out from ps task 0 costs a parameter-server step.

One job of 2 workers + 1 ps task (loopback, one thread per process). Each worker trains the seed
CNN (``towers.models.SeedCNN``, SGD) on synthetic 28x28 images under ``ParameterServerStrategy``
(async), alternating epochs whose batches come from ps task 0 (what ships) with epochs that use
the static split (``_dispatch_batches = False``); it also times a pass that only iterates the
batches (no step), which isolates the requests. Every pass ends at a barrier (a dispatched pass
ends together on every worker). Medians over ``--repeats`` epochs of each kind.

    python benchmarks/ps_dispatch.py --repeats 5

Results go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _job(repeats: int, examples: int, global_batch: int) -> dict[str, float] | None:
    import torch
    import torch.nn.functional as F

    import towers
    from towers.cluster.info import ProcessInfo
    from towers.models import SeedCNN

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    info = ProcessInfo(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                       master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                       strategy="ps", num_ps=1)
    strategy = towers.ParameterServerStrategy(num_ps=1, mode="async", info=info, exit_on_ps=False)
    if strategy.is_ps:
        return None
    torch.manual_seed(0)
    model = SeedCNN()
    model, optimizer = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(examples, 1, 28, 28, generator=g), torch.randint(0, 10, (examples,), generator=g))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    times: dict[str, list[float]] = {"dispatched": [], "static": [], "iterate_dispatched": [], "iterate_static": []}
    for i in range(repeats + 1):
        for kind in ("dispatched", "static"):
            strategy._dispatch_batches = kind == "dispatched"  # type: ignore[attr-defined]
            batches = strategy.distribute_dataset(data, global_batch, shuffle=False)
            strategy.barrier()
            # Each pass ends at a barrier: a dispatched pass ends together on every worker, a static one would
            # otherwise stop each worker's clock at its own last step (the Trainer reduces there anyway).
            t0 = time.perf_counter()
            n = sum(1 for _ in batches)
            strategy.barrier()
            iterate = (time.perf_counter() - t0) * 1e3 / n
            strategy.barrier()
            t0 = time.perf_counter()
            for x, y in batches:
                strategy.run(step, args=(x, y))
            strategy.barrier()
            train = (time.perf_counter() - t0) * 1e3 / n
            if i:  # the first round warms up
                times[kind].append(train)
                times[f"iterate_{kind}"].append(iterate)
    strategy.barrier()
    strategy.shutdown()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    """Run the job and print ms per step with and without dispatching."""
    import towers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=6400)
    parser.add_argument("--global-batch", type=int, default=128)
    args = parser.parse_args()
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}", flush=True)
    results = towers.spawn(_job, 3, args=(args.repeats, args.examples, args.global_batch), timeout_s=600,
                           threads_per_process=1)
    for w, r in enumerate(results[:2]):
        print(f"worker {w}: step {r['dispatched']:.2f} ms dispatched vs {r['static']:.2f} ms static "
              f"({r['dispatched'] / r['static']:.3f}x); fetching alone {r['iterate_dispatched']:.3f} vs "
              f"{r['iterate_static']:.3f} ms per batch", flush=True)
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
