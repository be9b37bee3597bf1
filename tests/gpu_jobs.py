"""The jobs of the multi-process GPU tests (tests/gpu): bodies of spawned ranks, importable by name.

Importable as ``gpu_jobs`` (tests/ is on the path), so ``towers.spawn`` and ``multiprocessing``'s
spawn context find these functions in their children by reference. Each body returns plain values
(tensors on the CPU, strings); the tests assert in the parent.
"""

from __future__ import annotations

import time
from typing import Any

GLOBAL_BATCH = 16
STEPS = 4


def tiny_mlp() -> Any:
    """Return the same small MLP every time, on whatever device it is created (linear layers only: no TF32 convolution).

    Created inside a strategy's scope on a GPU, a module draws its initial weights from the GPU's random generator,
    which gives other numbers than the CPU's for the same seed; so the weights are drawn on the CPU and copied in.
    """
    import torch
    from torch import nn

    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * 0.3)
    return net


def tiny_data(n: int = GLOBAL_BATCH * STEPS) -> tuple[Any, Any]:
    """Return ``n`` examples of 8 features and 3 classes, from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g, device="cpu"), torch.randint(0, 3, (n,), generator=g, device="cpu")


def train(strategy: Any) -> dict[str, Any]:
    """Train ``tiny_mlp`` for one epoch of ``tiny_data`` under ``strategy``; return final state and global losses."""
    import torch
    import torch.nn.functional as F

    import towers

    with strategy.scope():
        net = tiny_mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = strategy.prepare(net, optimizer)
    batches = strategy.distribute_dataset(tiny_data(), GLOBAL_BATCH, shuffle=True, seed=3)

    def step(x: Any, y: Any) -> Any:
        loss = towers.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses, devices = [], set()
    for x, y in batches:
        devices.add(str(x.device))
        losses.append(strategy.reduce("sum", strategy.run(step, args=(x, y))).detach().cpu())
    state = {k: v.detach().cpu().clone() for k, v in strategy.unwrap(model).state_dict().items()}
    return {"state": state, "losses": torch.stack(losses), "batch_devices": sorted(devices)}


# --- two processes, one host: Mirrored, and Gloo on CUDA tensors -------------------------------------
def mirrored_beside_gloo_on_cuda() -> dict[str, Any]:
    """One rank: a Gloo all-reduce of CUDA tensors, then Mirrored training as the strategy places the replicas."""
    import torch
    import torch.distributed as dist

    import towers

    strategy = towers.MirroredStrategy(timeout_s=60)
    rank = strategy.replica_id
    # Gloo on CUDA tensors, on a group of its own (the default group is NCCL where every replica has a GPU).
    gloo = dist.new_group(backend="gloo")
    gpu = torch.device("cuda", rank % torch.cuda.device_count())
    shared = torch.full((4,), float(rank + 1), device=gpu)
    dist.all_reduce(shared, group=gloo)
    gathered = [torch.zeros(2, device=gpu) for _ in range(strategy.num_replicas_in_sync)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=gpu), group=gloo)
    result = train(strategy)
    result.update(rank=rank, device=str(strategy.device), backend=str(dist.get_backend()),
                  gloo_sum=shared.cpu(), gloo_sum_device=str(shared.device),
                  gathered=torch.stack([t.cpu() for t in gathered]))
    strategy.shutdown()
    return result


# --- FSDP2 on one GPU: CPU offload and a MixedPrecisionPolicy ----------------------------------------
def blocks_model() -> Any:
    """Return a model whose repeated blocks sit in an ``nn.ModuleList`` (what ``shard_units="auto"`` picks)."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2))
            self.out = nn.Linear(32, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(0)
    return Net()


def fsdp_one_gpu_cpu_offload(precision: str = "bf16", steps: int = STEPS) -> dict[str, Any]:
    """One process (world 1) on cuda:0: towers' FSDP2 sharding with CPU offload and ``precision``'s policy.

    ``FullyShardedStrategy`` shards only with more than one process, so this calls the one place that
    applies ``fully_shard`` (``towers.parallel.fsdp.shard_model``) on a 1-rank mesh, as the strategy would.
    """
    import copy

    import torch
    import torch.nn.functional as F

    from towers.cluster import from_env
    from towers.process_group import init_process_group
    from towers.parallel.fsdp import build_mesh, fsdp_modules, shard_model

    info = from_env()
    backend = init_process_group(info, timeout_s=60)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model = blocks_model().to(device)
    reference = copy.deepcopy(model)  # the same maths in float32 on the GPU, unsharded
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    shard_model(model, build_mesh(1, "cuda"), precision=precision, cpu_offload=True)
    seen: list[tuple[str, str, str]] = []  # (weight dtype, weight device, output dtype) of each inner Linear

    def record(module: Any, _: Any, output: Any) -> None:
        seen.append((str(module.weight.dtype), module.weight.device.type, str(output.dtype)))

    for block in model.blocks:
        block[0].register_forward_hook(record)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x_all, y_all = tiny_data(steps * GLOBAL_BATCH)
    losses, ref_losses, grads, outputs = [], [], set(), set()
    for i in range(steps):
        x = x_all[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH].to(device)
        y = y_all[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH].to(device)
        out = model(x)
        outputs.add(str(out.dtype))
        loss = F.cross_entropy(out, y)
        loss.backward()
        grads.update((str(p.grad.dtype), p.grad.to_local().device.type) for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.detach().cpu())
    params = dict(model.named_parameters())
    return {
        "backend": backend,
        "units": len(fsdp_modules(model)),
        "param_types": sorted({type(p).__name__ for p in params.values()}),
        "param_places": sorted({(str(p.dtype), p.to_local().device.type) for p in params.values()}),
        "pinned": all(p.to_local().is_pinned() for p in params.values()),
        "seen": sorted(set(seen)), "outputs": sorted(outputs), "grads": sorted(grads),
        "losses": torch.stack(losses), "ref_losses": torch.stack(ref_losses),
        "state": {n: p.to_local().detach().cpu().clone() for n, p in params.items()},  # world 1: the shard is whole
        "ref_state": {n: p.detach().cpu().clone() for n, p in reference.named_parameters()},
        "initial": initial,
    }


# --- the stuck-rank watchdog around a CUDA collective ------------------------------------------------
def stuck_rank(env: dict[str, str], backend: str, device_type: str, out_path: str, err_path: str) -> None:
    """Entry point of one rank: stdout/stderr to files, the job's variables, then ``_stuck_job``; exits like a script."""
    from stuck_job import run_as_script

    run_as_script(env, out_path, err_path, _stuck_job, backend, device_type)


def _stuck_job(backend: str, device_type: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from towers.cluster import from_env
    from towers.process_group import init_process_group

    info = from_env()
    init_process_group(info, backend=backend, timeout_s=120)  # starts the watchdog (TOWERS_STUCK_TIMEOUT_S)
    if device_type == "cuda":
        # NCCL: one GPU per rank; Gloo: the ranks may share cuda:0 (a one-GPU host)
        device = torch.device("cuda", info.local_rank if backend == "nccl" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Past the watchdog's window of recent steps, so that neither its start-up allowance nor the first step (CUDA's
    # start-up, seconds) sets the bound: it is the minimum, BOUND_S.
    from towers.diagnostics.progress import RECENT_STEPS

    for _ in range(RECENT_STEPS + 2):
        model(torch.randn(8, 4, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        done = torch.ones(1, device=device)
        dist.all_reduce(done)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if info.rank == 1:
        from stuck_job import _spin_forever

        print(f"FAULT {time.time():.3f}", flush=True)
        _spin_forever()
    print(f"WAITING on {device}", flush=True)
    pending = torch.ones(1, device=device)
    dist.all_reduce(pending)  # Gloo blocks here; NCCL queues it on the GPU ...
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # ... and the host waits here (without the GIL)
    print("DONE", flush=True)
