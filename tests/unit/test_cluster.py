"""towers.cluster: every environment from plain dicts, the detection order, and the error messages."""

from __future__ import annotations

import json

import pytest

from towers import cluster
from towers.cluster import (
    ClusterConfigError,
    LocalEnvironment,
    SlurmEnvironment,
    TFConfigEnvironment,
    TorchrunEnvironment,
    expand_hostlist,
    from_env,
)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "123456",
         "SLURM_STEP_ID": "0"}  # an srun task
CLUSTER = {"chief": ["host0:2222"], "worker": ["host1:2222", "host1:2223"], "ps": ["host2:2222", "host2:2223"]}


def tf_config(task_type: str, index: int, cluster_: dict | None = None) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster_ or CLUSTER, "task": {"type": task_type, "index": index}})}


# --- single process ---------------------------------------------------------------------------
def test_empty_environment_is_one_local_process():
    info = from_env({})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (0, 1, 0, 1)
    assert info.is_chief and not info.is_distributed and info.source == "single"
    assert info.master_port is None and info.strategy is None and info.num_ps == 0


def test_local_environment_reads_towers_launch_options():
    info = LocalEnvironment().process_info({"TOWERS_STRATEGY": "One-Device", "MASTER_PORT": "1234"})
    assert info.strategy == "one_device" and info.master_port == 1234


# --- torchrun / Kubeflow ----------------------------------------------------------------------
def test_torchrun_variables():
    info = TorchrunEnvironment().process_info(TORCHRUN)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank) == (3, 4, 1, 2, 1)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29400)
    assert info.init_method == "tcp://10.0.0.1:29400"
    assert not info.is_chief and info.task == cluster.TaskInfo(type="worker", index=3)
    assert info.source == "torchrun"


def test_kubeflow_without_local_rank_is_one_process_per_pod():
    info = TorchrunEnvironment().process_info({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0",
                                               "MASTER_PORT": "23456"})
    assert (info.local_rank, info.local_world_size, info.node_rank) == (0, 1, 1)


def test_torchrun_towers_options_make_last_ranks_parameter_servers():
    env = {**TORCHRUN, "TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"}
    last = TorchrunEnvironment().process_info(env)
    first = TorchrunEnvironment().process_info({**env, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    assert last.task == cluster.TaskInfo(type="ps", index=0) and last.num_ps == 1 and last.strategy == "ps"
    assert first.task == cluster.TaskInfo(type="worker", index=0) and first.is_chief


@pytest.mark.parametrize("name, value", [("RANK", "one"), ("WORLD_SIZE", "0"), ("LOCAL_RANK", "-1"),
                                         ("MASTER_PORT", "http"), ("MASTER_PORT", "70000"), ("TOWERS_NUM_PS", "x")])
def test_bad_integer_names_the_variable(name, value):
    with pytest.raises(ClusterConfigError, match=name) as err:
        TorchrunEnvironment().process_info({**TORCHRUN, name: value})
    assert repr(value) in str(err.value) or value in str(err.value)


def test_rank_beyond_world_size():
    with pytest.raises(ClusterConfigError, match=r"RANK must be < WORLD_SIZE.*RANK=4, WORLD_SIZE=4"):
        TorchrunEnvironment().process_info({**TORCHRUN, "RANK": "4"})


def test_num_ps_leaving_no_worker():
    with pytest.raises(ClusterConfigError, match="leaves no worker"):
        TorchrunEnvironment().process_info({**TORCHRUN, "TOWERS_NUM_PS": "4"})


# --- SLURM ------------------------------------------------------------------------------------
def test_slurm_variables_and_port_from_job_id():
    info = SlurmEnvironment().process_info(SLURM)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank) == (5, 8, 1, 2, 2)
    assert info.master_addr == "gpu07"
    assert info.master_port == 15000 + 123456 % 20000 == cluster.port_from_job_id(123456)
    assert info.source == "slurm"


def test_slurm_prefers_master_variables_and_ntasks_per_node():
    info = SlurmEnvironment().process_info({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000",
                                            "SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "3"})
    assert (info.master_addr, info.master_port, info.local_world_size) == ("head", 4000, 4)


def test_slurm_uneven_tasks_per_node():
    info = SlurmEnvironment().process_info({**SLURM, "SLURM_NTASKS": "5", "SLURM_PROCID": "4",
                                            "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_LOCALID": "0"})
    assert info.local_world_size == 1


@pytest.mark.parametrize("hostlist, hosts", [
    ("node1", ["node1"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("gpu[1,3-4],login", ["gpu1", "gpu3", "gpu4", "login"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_bad_hostlist_names_the_variable():
    with pytest.raises(ClusterConfigError, match="SLURM_JOB_NODELIST"):
        SlurmEnvironment().process_info({**SLURM, "SLURM_JOB_NODELIST": "node[a-b]"})


def test_bad_slurm_integer_names_the_variable():
    with pytest.raises(ClusterConfigError, match=r"SLURM_PROCID.*'x'"):
        SlurmEnvironment().process_info({**SLURM, "SLURM_PROCID": "x"})


# --- TF_CONFIG --------------------------------------------------------------------------------
@pytest.mark.parametrize("task_type, index, rank", [
    ("chief", 0, 0), ("worker", 0, 1), ("worker", 1, 2), ("ps", 0, 3), ("ps", 1, 4)])
def test_tf_config_rank_order_is_chief_workers_ps(task_type, index, rank):
    info = TFConfigEnvironment().process_info(tf_config(task_type, index))
    assert info.rank == rank and info.world_size == 5
    assert info.task == cluster.TaskInfo(type=task_type, index=index)
    assert (info.master_addr, info.master_port) == ("host0", 2222)
    assert info.is_chief == (task_type == "chief")
    assert info.strategy == "ps" and info.num_ps == 2 and info.chief_rank == 0
    assert info.cluster.as_dict() == CLUSTER


def test_tf_config_local_and_node_ranks_follow_hosts():
    info = TFConfigEnvironment().process_info(tf_config("worker", 1))
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, 1)


def test_tf_config_without_chief_makes_worker_0_chief_and_mwms():
    spec = {"worker": ["a:1", "b:1", "c:1"]}
    infos = [TFConfigEnvironment().process_info(tf_config("worker", i, spec)) for i in range(3)]
    assert [i.rank for i in infos] == [0, 1, 2]
    assert [i.is_chief for i in infos] == [True, False, False]
    assert all(i.strategy == "multi_worker_mirrored" and i.num_ps == 0 for i in infos)
    assert all((i.master_addr, i.master_port) == ("a", 1) for i in infos)


def test_tf_config_evaluator_is_outside_the_training_group():
    spec = {**CLUSTER, "evaluator": ["host3:2222"]}
    info = TFConfigEnvironment().process_info(tf_config("evaluator", 0, spec))
    assert (info.rank, info.world_size) == (0, 1)
    assert info.is_evaluator and not info.is_chief
    worker = TFConfigEnvironment().process_info(tf_config("worker", 0, spec))
    assert worker.world_size == 5  # the evaluator does not count


def test_tf_config_ipv6_addresses():
    info = TFConfigEnvironment().process_info(tf_config("worker", 0, {"worker": ["[::1]:2222"]}))
    assert info.master_addr == "::1" and info.init_method == "tcp://[::1]:2222"


def test_towers_strategy_overrides_tf_config_default():
    env = {**tf_config("worker", 0, {"worker": ["a:1", "b:1"]}), "TOWERS_STRATEGY": "mirrored"}
    assert from_env(env).strategy == "mirrored"


@pytest.mark.parametrize("raw, what", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "no 'cluster'"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "no 'task'"),
    (json.dumps({"cluster": {}, "task": {"type": "worker", "index": 0}}), "'cluster' must be a non-empty object"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}), "out of range"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}), "out of range"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}), "must be an integer"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}), "must be an integer"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}}), "'task.type' must be one of"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}), "lists no 'ps' tasks"),
    (json.dumps({"cluster": {"master": ["a:1"]}, "task": {"type": "worker", "index": 0}}), "unknown task type 'master'"),
    (json.dumps({"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}), "not host:port"),
    (json.dumps({"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}}), "not host:port"),
    (json.dumps({"cluster": {"worker": ["::1:2"]}, "task": {"type": "worker", "index": 0}}), "not host:port"),
    (json.dumps({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}}), "must be a list"),
    (json.dumps({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}}), "more than one chief"),
    (json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}}), "no 'chief' or 'worker'"),
])
def test_malformed_tf_config_gives_one_clear_error(raw, what):
    with pytest.raises(ClusterConfigError) as err:
        from_env({"TF_CONFIG": raw})
    message = str(err.value)
    assert message.startswith("TF_CONFIG ")
    assert what in message
    assert "Received:" in message
    assert isinstance(err.value, ValueError)


# --- detection order --------------------------------------------------------------------------
def test_tf_config_beats_torchrun_beats_slurm_beats_single():
    tf = tf_config("worker", 0, {"worker": ["a:1", "b:1", "c:1", "d:1"]})
    matching_torchrun = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"}
    assert from_env({**tf, **matching_torchrun, **SLURM}).source == "tf_config"
    assert from_env({**TORCHRUN, **SLURM}).source == "torchrun"
    assert from_env(SLURM).source == "slurm"
    assert from_env({"UNRELATED": "1"}).source == "single"


def test_explicit_arguments_beat_every_environment():
    info = from_env({**TORCHRUN, **SLURM}, rank=0, master_port=1111, strategy="mirrored")
    assert (info.rank, info.world_size, info.master_port, info.strategy) == (0, 4, 1111, "mirrored")
    assert info.source == "explicit+torchrun"
    assert from_env({}, rank=1, world_size=2).rank == 1


def test_explicit_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="process_index"):
        from_env({}, process_index=1)


def test_explicit_inconsistent_values_name_the_problem():
    with pytest.raises(ClusterConfigError, match="rank must be in"):
        from_env({}, rank=3)


def test_tf_config_inherited_by_torchrun_workers_is_refused():
    env = {**tf_config("worker", 0, {"worker": ["a:1", "b:1"]}), "RANK": "1", "WORLD_SIZE": "4"}
    with pytest.raises(ClusterConfigError, match="TF_CONFIG and torchrun's variables disagree"):
        from_env(env)


def test_from_env_without_environ_reads_the_process_environment():
    assert isinstance(from_env(), cluster.ProcessInfo)


def test_describe_is_one_line():
    line = cluster.describe(TorchrunEnvironment().process_info(TORCHRUN))
    assert "\n" not in line and "rank 3/4" in line and "10.0.0.1:29400" in line and "torchrun" in line
