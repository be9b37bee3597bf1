"""What the docs write works as written: public import paths, options checked before any process group is joined,
and every strategy option the manifests must carry."""

from __future__ import annotations

import time

import pytest

import towers
from towers.cluster.info import ProcessInfo
from towers.deploy import DeploySpec
from towers.launch import free_port


@pytest.mark.parametrize("module, source", [("towers.callbacks", "towers.training.callbacks"),
                                            ("towers.metrics", "towers.training.metrics")])
def test_callbacks_and_metrics_import_as_the_docs_write_them(module, source):
    import importlib

    public, private = importlib.import_module(module), importlib.import_module(source)
    for name in public.__all__:
        assert getattr(public, name) is getattr(private, name), name
    assert getattr(towers, module.split(".")[1]) is public
    from towers.callbacks import BackupAndRestore  # noqa: F401  (the lines users write)
    from towers.checkpoint import CheckpointManager  # noqa: F401
    from towers.metrics import Accuracy  # noqa: F401


@pytest.mark.timeout(60)
@pytest.mark.parametrize("factory", [towers.MirroredStrategy, towers.FullyShardedStrategy])
@pytest.mark.parametrize("option, message", [({"precision": "bf17"}, "precision must be one of"),
                                             ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps")])
def test_a_typo_in_an_option_fails_before_the_process_group_is_joined(factory, option, message):
    # Rank 0 of 2: joining would wait for rank 1, which never comes.
    info = ProcessInfo(rank=0, world_size=2, local_world_size=2, master_port=free_port())
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        factory(info=info, timeout_s=30, **option)
    assert time.monotonic() - started < 5  # at once, not after a rendezvous timeout


@pytest.mark.parametrize("strategy", ["ps", "parameter_server", "hybrid", "hybrid_ps"])
def test_manifests_carry_num_ps_for_every_strategy_with_ps_tasks(strategy):
    spec = DeploySpec(name="job", script="train.py", strategy=strategy, num_ps=2, nproc_per_node="3")
    args = spec.launch_args()
    assert args[args.index("--num-ps") + 1] == "2"
    assert "--num-ps" not in DeploySpec(name="job", script="train.py", strategy="mirrored").launch_args()


# --- strategy options from outside the script ---------------------------------------------------
def test_launcher_options_reach_the_strategy_and_the_scripts_own_other_options_do_not_break_it():
    from towers.cluster import from_env

    info = from_env({"TOWERS_STRATEGY": "one_device", "TOWERS_STRATEGY_OPTIONS": '{"precision": "bf16"}'})
    assert info.strategy_options == {"precision": "bf16"}
    assert towers.strategy_from_env(info).precision.name == "bf16"
    # the launcher wins over the script's own value
    assert towers.strategy_from_env(info, precision="32").precision.name == "bf16"
    # the same script under a strategy without parameter servers: mode= is left out, not an error
    plain = ProcessInfo(strategy="one_device")
    assert towers.strategy_from_env(plain, mode="sync").name == "one_device"
    with pytest.raises(TypeError, match="no strategy takes.*Received: mood='sync'"):
        towers.strategy_from_env(plain, mood="sync")
    wrong = ProcessInfo(strategy="one_device", strategy_options={"mode": "async"})
    with pytest.raises(ValueError, match=r"'one_device' does not take the option 'mode'.*option of \['hybrid', 'ps'\]"):
        towers.strategy_from_env(wrong)


def test_strategy_options_on_the_command_line_and_in_manifests():
    from towers.cluster import ClusterConfigError, from_env
    from towers.launch.spec import parse_launch_args

    spec = parse_launch_args(["--nproc-per-node", "3", "--strategy", "ps", "--strategy-option", "mode=sync",
                              "--strategy-option", "staleness=2", "train.py", "--mode", "x"])
    assert dict(spec.strategy_options) == {"mode": "sync", "staleness": 2} and spec.script_args == ("--mode", "x")
    env = spec.worker_environment({})
    assert from_env({**env, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).strategy_options == {"mode": "sync",
                                                                                               "staleness": 2}
    for argv, message in ((["--strategy-option", "mode=sync", "t.py"], "needs --strategy"),
                          (["--strategy", "ps", "--strategy-option", "mode", "t.py"], "expects KEY=VALUE"),
                          (["--strategy", "ps", "--strategy-option", "a=1", "--strategy-option", "a=2", "t.py"],
                           "given twice")):
        with pytest.raises(ValueError, match=message):
            parse_launch_args(["--nproc-per-node", "2", *argv])
    with pytest.raises(ClusterConfigError, match="TOWERS_STRATEGY_OPTIONS must be a JSON object"):
        from_env({"TOWERS_STRATEGY_OPTIONS": "{mode: async"})
    spec = DeploySpec(name="job", script="train.py", strategy="hybrid", num_ps=1, nproc_per_node="3",
                      strategy_options={"mode": "async", "staleness": 2})
    args = spec.launch_args()
    assert args[args.index("--strategy-option") + 1] == "mode=async" and "staleness=2" in args
