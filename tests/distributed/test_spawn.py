"""towers.spawn: results in rank order, a failing or dying rank stops the job, the deadline holds."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import towers
from towers.cluster.info import ProcessInfo
from towers.launch import SpawnError
from towers.process_group import init_process_group

pytestmark = pytest.mark.timeout(120)


def _info_from_env() -> ProcessInfo:
    # The test builds ProcessInfo itself so this file tests spawn alone, not cluster detection.
    env = os.environ
    return ProcessInfo(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env["LOCAL_RANK"]), local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                       master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))


def _all_reduce_rank(mode: str) -> dict:
    info = _info_from_env()
    init_process_group(info, timeout_s=30)
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value)
    if mode == "raise" and info.rank == 1:
        raise ValueError("rank one refuses")
    if mode == "exit" and info.rank == 1:
        os._exit(3)
    if mode == "hang":
        dist.recv(torch.zeros(1), src=1 - info.rank)  # both wait to receive: a real deadlock
    return {"rank": info.rank, "sum": value.item(), "threads": torch.get_num_threads(), "pid": os.getpid(),
            "env_extra": os.environ.get("TOWERS_TEST_EXTRA")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_spawn_returns_each_rank_value_in_rank_order():
    results = towers.spawn(_all_reduce_rank, 2, args=("ok",), timeout_s=60, env={"TOWERS_TEST_EXTRA": "yes"})
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    # two CPU replicas on a 2-core host get one thread each (no oversubscription)
    cores = len(os.sched_getaffinity(0))
    assert all(r["threads"] == max(1, cores // 2) for r in results)
    assert all(r["env_extra"] == "yes" for r in results)
    assert not any(_alive(r["pid"]) for r in results)


@pytest.mark.parametrize("mode, status", [("raise", "error"), ("exit", "died")])
def test_a_failing_rank_fails_the_job_and_names_the_rank(mode, status):
    with pytest.raises(SpawnError) as info:
        towers.spawn(_all_reduce_rank, 2, args=(mode,), timeout_s=60)
    states = {s.rank: s for s in info.value.states}
    assert states[1].status == status
    assert "rank 1 of 2 failed" in str(info.value)
    if mode == "raise":
        assert "rank one refuses" in str(info.value)
    else:
        assert "code 3" in states[1].detail


def test_deadline_stops_a_hung_job_quickly():
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        towers.spawn(_all_reduce_rank, 2, args=("hang",), timeout_s=8)
    elapsed = time.monotonic() - start
    assert elapsed < 8 + 10  # deadline plus the stop grace, not the 30 s group timeout
    assert "did not finish within timeout_s=8" in str(info.value)
    assert {s.status for s in info.value.states} <= {"running", "ok"}


def _local_function_payload():
    return 42


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs must be a positive integer"):
        towers.spawn(_local_function_payload, 0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        towers.spawn(_local_function_payload, 1, timeout_s=0)
