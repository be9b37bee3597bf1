"""Several processes on the GPU(s): two ranks on one host, FSDP2 with CPU offload, the stuck-rank watchdog, bench.

Each job has a deadline owned by this process (``towers.spawn``'s ``timeout_s``, or the watchdog
test's own), and the assertions run here, on the values the ranks returned. The rank bodies live
in tests/gpu_jobs.py, importable by name from the spawned children.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gpu_jobs
import towers
from cli_support import run
from towers.cluster.info import ProcessInfo

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device; none is visible"),
    pytest.mark.timeout(180),
]

SPAWN_TIMEOUT_S = 120


def test_two_processes_on_one_host_train_as_one_device_and_gloo_moves_cuda_tensors():
    ranks = towers.spawn(gpu_jobs.mirrored_beside_gloo_on_cuda, 2, timeout_s=SPAWN_TIMEOUT_S)
    reference = gpu_jobs.train(towers.OneDeviceStrategy("/gpu:0", info=ProcessInfo()))
    for rank, got in enumerate(ranks):
        assert got["rank"] == rank
        # Gloo reduced and gathered tensors that live on the GPU, and left them there
        assert got["gloo_sum_device"].startswith("cuda")
        assert torch.equal(got["gloo_sum"], torch.full((4,), 3.0))
        assert torch.equal(got["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
        # Replicas never share a GPU: with one GPU both compute on the CPU over Gloo (and the idle-GPU
        # warning says so); with two or more each has its own GPU and NCCL.
        if GPUS >= 2:
            assert (got["device"], got["backend"]) == (f"cuda:{rank}", "nccl")
        else:
            assert (got["device"], got["backend"]) == ("cpu", "gloo")
        assert got["batch_devices"] == [got["device"]]
        # the same maths: the Mirrored pair ends where one device on the global batch ends
        assert torch.allclose(got["losses"], reference["losses"], rtol=1e-4, atol=1e-5), (got["losses"],
                                                                                           reference["losses"])
        for key, value in reference["state"].items():
            assert torch.allclose(got["state"][key], value, rtol=1e-4, atol=1e-5), (rank, key)
    for key in ranks[0]["state"]:
        assert torch.equal(ranks[0]["state"][key], ranks[1]["state"][key]), f"the replicas drifted apart at {key}"


def test_fsdp2_on_one_gpu_offloads_to_the_cpu_and_computes_in_bf16():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16 support (needs Ampere or newer)")
    (got,) = towers.spawn(gpu_jobs.fsdp_one_gpu_cpu_offload, 1, kwargs={"precision": "bf16"},
                          timeout_s=SPAWN_TIMEOUT_S)
    assert got["backend"] == ("nccl" if dist.is_nccl_available() else "gloo")
    assert got["units"] == 3  # the two blocks of the ModuleList and the root
    # CPUOffloadPolicy: the sharded float32 master weights and their gradients live in pinned host memory ...
    assert got["param_types"] == ["DTensor"]
    assert got["param_places"] == [("torch.float32", "cpu")]
    assert got["pinned"]
    assert got["grads"] == [("torch.float32", "cpu")]  # reduce_dtype float32
    # ... while MixedPrecisionPolicy gathers them onto the GPU in bf16 for compute, and returns float32 outputs
    assert got["seen"] == [("torch.bfloat16", "cuda", "torch.bfloat16")]
    assert got["outputs"] == ["torch.float32"]
    # bf16 compute follows the float32 run closely (bf16 keeps ~3 significant digits)
    assert torch.allclose(got["losses"], got["ref_losses"], rtol=3e-2), (got["losses"], got["ref_losses"])
    for name, value in got["ref_state"].items():
        assert got["state"][name].shape == value.shape, name
        update, ref_update = got["state"][name] - got["initial"][name], value - got["initial"][name]
        assert ref_update.norm() > 0, name
        # the sharded, offloaded bf16 run moved each parameter as the float32 run did, to within 10%
        assert (update - ref_update).norm() < 0.1 * ref_update.norm(), (name, update, ref_update)


# --- the stuck-rank watchdog around a CUDA collective ------------------------------------------------
BOUND_S = 3.0
DEADLINE_S = 60.0


def _run_stuck_job(tmp_path: Path, backend: str) -> dict:
    
    from cli_support import wait_for_exits
    from towers.launch.spawn import free_port

    port, world = free_port(), 2
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TMPDIR": str(tmp_path), "TOWERS_STUCK_TIMEOUT_S": str(BOUND_S)}
        for key in [k for k in os.environ if k.startswith(("TOWERS_", "TORCHELASTIC_", "TF_CONFIG", "SLURM_"))]:
            env.setdefault(key, "")
        p = ctx.Process(target=gpu_jobs.stuck_rank, args=(env, backend, "cuda", str(tmp_path / f"out{rank}"),
                                                          str(tmp_path / f"err{rank}")), daemon=True)
        p.start()
        procs.append(p)
    exited_at: dict[int, float] = {}
    try:
        exited_at = wait_for_exits(procs, deadline_s=DEADLINE_S)
    finally:
        left = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    read = lambda name: (tmp_path / name).read_text() if (tmp_path / name).exists() else ""  # noqa: E731
    return {"codes": [p.exitcode for p in procs], "exited_at": exited_at, "left": left,
            "out": [read(f"out{r}") for r in range(world)], "err": [read(f"err{r}") for r in range(world)],
            "reports": sorted(tmp_path.glob("towers-stuck-*.txt"))}


@pytest.mark.parametrize("backend", [
    "gloo",  # CUDA tensors over Gloo: two ranks may share one GPU
    pytest.param("nccl", marks=pytest.mark.skipif(GPUS < 2, reason="NCCL needs a GPU per rank: 2 GPUs; "
                                                                     f"{GPUS} visible")),
])
def test_the_watchdog_names_the_stuck_rank_while_the_other_waits_in_a_cuda_collective(tmp_path, backend):
    job = _run_stuck_job(tmp_path, backend)
    logs = "\n".join(f"--- rank {r} stdout:\n{o}\nstderr:\n{e}" for r, (o, e) in enumerate(zip(job["out"], job["err"])))
    assert sorted(job["exited_at"]) == [0, 1], f"ranks still running at the deadline: {job['left']}\n{logs}"
    assert job["codes"] == [124, 124], f"exit codes {job['codes']}\n{logs}"
    assert "WAITING on cuda" in job["out"][0] and all("DONE" not in out for out in job["out"]), logs
    fault_at = float(next(line for line in job["out"][1].splitlines() if line.startswith("FAULT")).split()[1])
    assert max(job["exited_at"].values()) - fault_at < BOUND_S + 15, logs
    assert len(job["reports"]) == 1, f"{job['reports']}\n{logs}"
    report = job["reports"][0].read_text()
    assert "Stuck: rank 1.\n" in report, report
    assert "rank 1 is not in any collective while rank(s) 0 wait" in report, report
    where = report.split("Where each rank is:\n", 1)[1].split("Python stacks:", 1)[0]
    rank0 = next(line for line in where.splitlines() if line.startswith("  rank 0 ("))
    assert "all_reduce" in rank0, report  # the CUDA collective rank 0 waits in, from torch's flight recorder
    assert "_spin_forever" in report.split("--- rank 1 ---\n", 1)[1], report


# --- towers bench on the GPU -------------------------------------------------------------------------
def test_towers_bench_runs_both_engines_on_the_gpu(tmp_path):
    out_dir = tmp_path / "bench"
    result = run([sys.executable, "-m", "towers.cli", "bench", "--replicas", "1", "--steps", "4", "--warmup", "2",
                  "--repeats", "1", "--batch-size", "64", "--no-plot", "--out-dir", str(out_dir)],
                 cwd=tmp_path, deadline_s=150)
    assert result.returncode == 0, result.stderr
    assert "sit idle" not in result.stderr and "sits idle" not in result.stderr, result.stderr
    data = json.loads((out_dir / "bench.json").read_text())
    assert data["environment"]["devices"] == ["cuda:0"]  # raw torch and towers both computed on the GPU
    rows = {(r["strategy"], r["replicas"]): r for r in data["rows"]}
    assert set(rows) == {("raw_ddp", 1), ("mirrored", 1)}
    assert rows[("mirrored", 1)]["engine"] == "OneDeviceStrategy"
    for row in rows.values():
        assert row["median"] > 0
        assert 0 < row["memory_mib"] < 4096  # torch's peak GPU memory for the seed CNN, not the process's RSS
