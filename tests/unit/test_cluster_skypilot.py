"""SkyPilot's variables (``SKYPILOT_NODE_IPS``, ``_NODE_RANK``, ``_NUM_NODES``, ``_NUM_GPUS_PER_NODE``) read by
``towers.cluster.from_env()`` (one process per node) and by ``towers launch`` (its node flags), from dicts."""

from __future__ import annotations

import pytest

from towers.cluster import ClusterConfigError, from_env
from towers.cluster.skypilot import DEFAULT_PORT, launch_flags
from towers.launch.spec import parse_launch_args

NODE_1 = {"SKYPILOT_NODE_IPS": "10.1.0.4\n10.1.0.7\n", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
          "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": "sky-2026-11-29-train"}


def test_a_process_started_by_skypilot_is_one_process_per_node_with_the_head_as_rendezvous():
    info = from_env(NODE_1)
    assert (info.source, info.rank, info.world_size, info.node_rank) == ("skypilot", 1, 2, 1)
    assert (info.local_rank, info.local_world_size, info.is_chief) == (0, 1, False)
    assert (info.master_addr, info.master_port) == ("10.1.0.4", DEFAULT_PORT)
    head = from_env({**NODE_1, "SKYPILOT_NODE_RANK": "0", "MASTER_PORT": "8008", "TOWERS_STRATEGY": "mirrored"})
    assert (head.rank, head.is_chief, head.master_port, head.strategy) == (0, True, 8008, "mirrored")


def test_towers_launch_inside_skypilot_is_torchruns_process_not_skypilots():
    worker = from_env({**NODE_1, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.1.0.4", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "x"})
    assert (worker.source, worker.rank, worker.world_size) == ("torchrun", 3, 4)


def test_towers_launch_takes_its_node_flags_from_skypilot_and_the_command_line_wins():
    assert launch_flags({}) == []
    spec = parse_launch_args(["--master-port", "29400", "train.py"], environ=NODE_1, gpu_count=0, cpu_count=2)
    assert (spec.min_nodes, spec.max_nodes, spec.node_rank, spec.master_addr) == (2, 2, 1, "10.1.0.4")
    gpus = {**NODE_1, "SKYPILOT_NUM_GPUS_PER_NODE": "4"}
    assert launch_flags(gpus)[-2:] == ["--nproc-per-node", "4"]
    assert parse_launch_args(["--master-port", "29400", "train.py"], environ=gpus, gpu_count=4).nproc_per_node == 4
    own = parse_launch_args(["--nproc-per-node", "2", "--master-addr", "10.9.9.9", "--master-port", "29400", "train.py"],
                            environ=gpus, gpu_count=4)
    assert (own.nproc_per_node, own.master_addr, own.node_rank) == (2, "10.9.9.9", 1)


@pytest.mark.parametrize("variables, named", [
    ({"SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NUM_NODES=3 but SKYPILOT_NODE_IPS lists 2"),
    ({"SKYPILOT_NODE_RANK": "2"}, "SKYPILOT_NODE_RANK must be < SKYPILOT_NUM_NODES"),
    ({"SKYPILOT_NODE_RANK": "one"}, "SKYPILOT_NODE_RANK"),
])
def test_variables_that_disagree_get_one_error_naming_them(variables, named):
    with pytest.raises(ClusterConfigError, match=named):
        from_env({**NODE_1, **variables})
    with pytest.raises(ValueError, match=named):
        parse_launch_args(["train.py"], environ={**NODE_1, **variables}, gpu_count=0, cpu_count=2)
