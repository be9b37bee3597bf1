"""towers.cluster: a SLURM allocation shell, Kubeflow Trainer v2's PET_* variables, MPI launchers, the join timeout."""

from __future__ import annotations

import json

import pytest

from towers.cluster import (
    DEFAULT_JOIN_TIMEOUT_S,
    ClusterConfigError,
    KubeflowTrainerEnvironment,
    MPIEnvironment,
    ProcessInfo,
    from_env,
)

SRUN_TASK = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]",
             "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}
BATCH_SHELL = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
               "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42", "SLURM_TASKS_PER_NODE": "2(x2)"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29500"}
PET = {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-node-0-0.job",
       "PET_MASTER_PORT": "29400"}


# --- SLURM: only srun tasks are processes of a multi-process job ------------------------------------
def test_an_srun_task_counts_the_step_not_the_allocation():
    info = from_env(SRUN_TASK)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 1, 2, 1, 2)


def test_a_batch_or_salloc_shell_with_several_tasks_is_refused_with_the_fix():
    with pytest.raises(ClusterConfigError) as err:
        from_env(BATCH_SHELL)
    message = str(err.value)
    assert "\n" not in message
    assert "SLURM allocation shell" in message and "SLURM_NTASKS=4" in message and "SLURM_STEP_ID is unset" in message
    assert "srun python SCRIPT" in message and "towers launch" in message


def test_a_one_task_allocation_shell_is_one_process():
    info = from_env({**BATCH_SHELL, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})
    assert (info.source, info.rank, info.world_size) == ("slurm", 0, 1)


def test_mpirun_inside_an_allocation_is_read_from_mpi():
    assert from_env({**BATCH_SHELL, **OMPI}).source == "mpi"
    assert from_env({**SRUN_TASK, "PMI_RANK": "1", "PMI_SIZE": "2"}).source == "slurm"  # srun --mpi=pmi2


# --- Kubeflow Trainer v2: PET_* only ---------------------------------------------------------------
def test_pet_variables_alone_describe_one_process_per_pod():
    info = from_env(PET)
    assert (info.source, info.rank, info.world_size, info.node_rank, info.local_world_size) == (
        "kubeflow_trainer", 2, 3, 2, 1)
    assert (info.master_addr, info.master_port, info.is_chief) == ("job-node-0-0.job", 29400, False)


def test_pet_with_several_processes_per_pod_asks_for_a_launcher():
    with pytest.raises(ClusterConfigError, match=r"PET_NPROC_PER_NODE='4'.*`torchrun` or `towers launch`"):
        KubeflowTrainerEnvironment().process_info({**PET, "PET_NPROC_PER_NODE": "4"})


def test_torchrun_variables_beat_pet_variables():
    env = {**PET, "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
           "MASTER_PORT": "1"}
    assert from_env(env).source == "torchrun"


def test_pet_without_master_address_across_nodes_is_refused():
    env = {k: v for k, v in PET.items() if k != "PET_MASTER_ADDR"}
    with pytest.raises(ClusterConfigError, match="PET_MASTER_ADDR is not set"):
        from_env(env)


# --- MPI ----------------------------------------------------------------------------------------
def test_open_mpi_variables():
    info = MPIEnvironment().process_info(OMPI)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank) == (3, 4, 1, 2, 1)
    assert (info.master_addr, info.master_port, info.source) == ("10.1.0.1", 29500, "mpi")


def test_pmi_variables_on_one_host_default_to_loopback():
    info = from_env({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
                     "MASTER_PORT": "29501"})
    assert (info.source, info.rank, info.world_size, info.master_addr, info.master_port) == (
        "mpi", 0, 2, "127.0.0.1", 29501)


@pytest.mark.parametrize("missing, message", [("MASTER_ADDR", "does not say where the rendezvous is"),
                                              ("MASTER_PORT", "MASTER_PORT is not set")])
def test_mpi_across_hosts_needs_the_rendezvous_address(missing, message):
    with pytest.raises(ClusterConfigError, match=message):
        from_env({k: v for k, v in OMPI.items() if k != missing})


# --- join timeout and how a rank is named ----------------------------------------------------------
def test_join_timeout_comes_from_the_environment():
    assert from_env({}).join_timeout_s == DEFAULT_JOIN_TIMEOUT_S
    assert from_env({"TOWERS_JOIN_TIMEOUT_S": "12.5"}).join_timeout_s == 12.5
    for bad in ("0", "-3", "soon", "inf"):
        with pytest.raises(ClusterConfigError, match=f"TOWERS_JOIN_TIMEOUT_S must be.*{bad!r}"):
            from_env({"TOWERS_JOIN_TIMEOUT_S": bad})


def test_ranks_are_named_by_task_address_or_node():
    tf = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["h0:1"], "worker": ["h1:2"], "ps": ["h2:3"]},
                                   "task": {"type": "worker", "index": 0}})}
    info = from_env(tf)
    assert [info.describe_rank(r) for r in range(3)] == [
        "rank 0 (chief:0 at h0:1)", "rank 1 (worker:0 at h1:2)", "rank 2 (ps:0 at h2:3)"]
    spread = ProcessInfo(rank=0, world_size=4, local_world_size=2, num_ps=1)
    assert spread.describe_rank(1) == "rank 1 (node 0)" and spread.describe_rank(3) == "rank 3 (ps:0, node 1)"
    assert ProcessInfo(world_size=2, local_world_size=2).describe_rank(1) == "rank 1"
