"""MirroredStrategy's mesh without processes: what a tp mesh cannot run with is refused before the group is joined.

What runs on 4 processes (the maths against one device) is tests/distributed/test_mirrored_tensor_parallel.py.
"""

from __future__ import annotations

import pytest

from towers.cluster.info import ProcessInfo
from towers.launch.spec import parse_launch_args
from towers.strategies.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from towers.strategies.registry import check_strategy_options

INFO = ProcessInfo(rank=0, world_size=4, local_rank=0, local_world_size=4)


@pytest.mark.parametrize("options, message", [
    ({"mesh": "pp=2,dp=2"}, r"MirroredStrategy does not cut a model into pipeline stages. Received: mesh pp=2,dp=2. "
                            r"Use --strategy sharded for pipeline stages"),
    ({"mesh": "pp=2,tp=2"}, r"does not cut a model into pipeline stages. Received: mesh pp=2,tp=2"),
    ({"mesh": "dp=2,tp=2", "gradient_compression": "powersgd"},
     r"gradient_compression='powersgd' cannot run with a tp mesh.*Received: gradient_compression='powersgd', mesh "
     r"dp=2,tp=2. Use gradient_compression='bf16' or 'fp16'"),
    ({"mesh": "dp=2,tp=2", "sync_batchnorm": True},
     r"sync_batchnorm cannot run with a tp mesh.*Received: sync_batchnorm=True, mesh dp=2,tp=2. Drop sync_batchnorm"),
    ({"mesh": "tp=4", "precision": "fp16"},
     r"precision='fp16' cannot run with a tp mesh.*Received: precision='fp16', mesh tp=4. Use precision='bf16'"),
    ({"mesh": "dp=3,tp=2"}, r"span the job's 4 process.*dp=3,tp=2 \(6 processes\)"),
    ({"mesh": "dp_replicate=2,dp_shard=2"}, r"MirroredStrategy does not shard.*Received: mesh dp_replicate=2,dp_shard=2. "
                                             r"Use mesh dp=4 for replicas, or --strategy sharded for dp_shard"),
])
def test_what_a_tp_mesh_cannot_run_with_is_refused_before_joining_the_group(options, message):
    # world_size 4 and no process group: a refusal that came after the join would hang here instead
    with pytest.raises(ValueError, match=message):
        MirroredStrategy(info=INFO, **options)
    with pytest.raises(ValueError, match=message):
        MultiWorkerMirroredStrategy(info=INFO, **options)


def test_mirrored_takes_the_mesh_and_a_plan_from_the_launcher():
    spec = parse_launch_args(["--nproc-per-node", "4", "--strategy", "mirrored", "--mesh", "dp=2,tp=2", "t.py"])
    assert spec.strategy_options["mesh"] == "dp=2,tp=2"
    check_strategy_options("mirrored", {"mesh": "dp=2,tp=2", "tp_plan": "auto"})
    check_strategy_options("multi_worker_mirrored", {"mesh": "dp=2,tp=2"})
    with pytest.raises(ValueError, match="does not take the option 'mesh'"):
        check_strategy_options("ps", {"mesh": "dp=2,tp=2"})


def test_without_a_tp_mesh_one_process_builds_no_mesh():
    one = ProcessInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)
    for mesh in (None, "dp=1", {"dp": 1}):
        strategy = MirroredStrategy(info=one, mesh=mesh)
        assert strategy.mesh is None and strategy.tensor_parallel_size == 1 and strategy.num_replicas_in_sync == 1
        assert strategy.is_chief
