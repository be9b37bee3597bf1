"""A Ray Train worker described from its variables (``towers.cluster.ray``), and the Ray integration's refusals,
without a Ray cluster: the variables are the ones Ray Train 2.60's torch backend sets in each worker."""

from __future__ import annotations

import sys

import pytest

import towers
from towers.cluster import RayTrainEnvironment, from_env
from towers.cluster.ray import at_loop_end, ps_task_started
from towers.errors import FailedPreconditionError
from towers.process_group import DistributedError, init_process_group
from towers.strategies.parameter_server.roles import resolve_roles

RAY_WORKER = {"RAY_JOB_ID": "01000000", "RAY_RAYLET_PID": "658", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2",
              "LOCAL_WORLD_SIZE": "3", "NODE_RANK": "0", "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "39807",
              "ACCELERATE_TORCH_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}


def test_a_ray_train_worker_is_described_from_the_variables_ray_sets():
    info = from_env(RAY_WORKER)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("ray", 2, 3, 2, 3)
    assert (info.master_addr, info.master_port, info.node_rank, info.is_chief) == ("192.0.2.2", 39807, 0, False)
    assert (info.agent_store, info.restart_count, info.num_ps, info.task.type) == (False, 0, 0, "worker")
    chief = from_env({**RAY_WORKER, "RANK": "0", "LOCAL_RANK": "0"})
    assert chief.is_chief and chief.source == "ray"


def test_the_strategy_and_ps_count_from_outside_apply_under_ray_as_under_towers_launch():
    info = from_env({**RAY_WORKER, "TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1",
                     "TOWERS_STRATEGY_OPTIONS": '{"mode": "sync"}'})
    assert (info.strategy, info.num_ps, info.task.type, info.task.index) == ("ps", 1, "ps", 0)
    assert dict(info.strategy_options) == {"mode": "sync"}


def test_torchrun_started_inside_a_ray_task_is_torchruns_job_and_plain_ray_is_one_process():
    under_torchrun = from_env({**RAY_WORKER, "TORCHELASTIC_RUN_ID": "abc", "GROUP_RANK": "0"})
    assert under_torchrun.source == "torchrun"
    assert from_env({"RAY_JOB_ID": "01000000"}).source == "single"  # a Ray task, no Train worker
    assert RayTrainEnvironment().detect(RAY_WORKER)


def test_a_ps_task_under_ray_outside_train_loop_is_refused_with_the_fix():
    info = from_env(RAY_WORKER)
    with pytest.raises(FailedPreconditionError, match=r"(?s)towers.ray.train_loop.*num_workers=3\)\): 2 worker\(s\) and 1 ps"):
        resolve_roles(info, 1)
    ps_task_started(from_env({}), 0, 2, 1)  # not a Ray worker: nothing to do
    assert at_loop_end(lambda: None) is False  # outside a wrapped function: the caller keeps its atexit


def test_a_ray_worker_without_a_process_group_is_refused_instead_of_making_a_second_one():
    with pytest.raises(DistributedError, match="no torch process group.*TorchTrainer"):
        init_process_group(from_env(RAY_WORKER))


def test_without_ray_installed_the_entry_points_name_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # any `import ray` now fails
    for call in (lambda: towers.ray.train_loop(lambda: None), lambda: towers.ray.latest_checkpoint(),
                 lambda: towers.ray.report({"loss": 1.0})):
        with pytest.raises(ImportError, match=r"pip install 'towers\[ray\]'"):
            call()


def test_metrics_reach_ray_as_numbers():
    import torch

    got = towers.ray.ray_metrics({"loss": torch.tensor(0.5), "examples": 1438, "ok": True, "name": "x",
                                  "lr": 2e-3, "hist": [1, 2], "big": torch.ones(3)})
    assert got == {"loss": 0.5, "examples": 1438, "ok": True, "name": "x", "lr": 2e-3}


def test_the_wrapped_function_and_report_outside_a_ray_worker_say_where_they_belong():
    pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install 'towers[ray]'")

    def train_func(config):
        return config

    wrapped = towers.ray.train_loop(train_func)
    assert wrapped.__wrapped__ is train_func  # Ray reads the signature through it: fn(config) or fn()
    with pytest.raises(FailedPreconditionError, match="inside a Ray Train worker.*'single'"):
        wrapped({})
    with pytest.raises(FailedPreconditionError, match="towers.ray.train_loop"):
        towers.ray.report({"loss": 1.0})
    with pytest.raises(TypeError, match="BackupAndRestore"):
        towers.ray.RayReport(backup="ckpt/")
