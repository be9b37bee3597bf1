"""LaunchSpec validation, torchrun flag parsing, worker environment and pre-start checks (no process starts)."""

from __future__ import annotations

import signal
import socket
from types import SimpleNamespace

import pytest

from towers.cli import main
from towers.launch.launcher import LaunchError, _failure_error, preflight, resolve_ports
from towers.launch.spec import (
    LaunchSpec,
    canonical_strategy,
    parse_launch_args,
    parse_nnodes,
    resolve_nproc_per_node,
)


def spec(**kwargs) -> LaunchSpec:
    return LaunchSpec(**{"script": "train.py", **kwargs})


# --- small parsers ----------------------------------------------------------------------------
@pytest.mark.parametrize("name, canonical", [
    ("mirrored", "mirrored"), ("Parameter-Server", "ps"), ("parameter_server", "ps"), ("ps", "ps"),
    ("one_device", "one_device"), ("multi-worker-mirrored", "multi_worker_mirrored")])
def test_canonical_strategy(name, canonical):
    assert canonical_strategy(name) == canonical


def test_unknown_strategy_lists_choices():
    with pytest.raises(ValueError, match=r"Unknown strategy.*one_device, mirrored, multi_worker_mirrored, ps.*Received: 'bogus'"):
        canonical_strategy("bogus")


@pytest.mark.parametrize("value, gpus, cpus, expected", [
    ("3", 0, 2, 3), (4, 0, 2, 4), ("cpu", 8, 2, 2), ("gpu", 8, 2, 8), ("auto", 8, 2, 8), ("auto", 0, 2, 2)])
def test_resolve_nproc_per_node_like_torchrun(value, gpus, cpus, expected):
    assert resolve_nproc_per_node(value, gpu_count=gpus, cpu_count=cpus) == expected


@pytest.mark.parametrize("value, message", [("gpu", "needs a CUDA GPU"), ("0", ">= 1"), ("many", "auto")])
def test_resolve_nproc_per_node_errors(value, message):
    with pytest.raises(ValueError, match=message):
        resolve_nproc_per_node(value, gpu_count=0, cpu_count=2)


def test_parse_nnodes():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "4:2", "a", "1:2:3"):
        with pytest.raises(ValueError, match="--nnodes"):
            parse_nnodes(bad)


# --- LaunchSpec validation --------------------------------------------------------------------
def test_spec_is_frozen_and_keyword_only():
    s = spec(nproc_per_node=2)
    with pytest.raises(AttributeError):
        s.nproc_per_node = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LaunchSpec("train.py")  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    ({"script": ""}, "needs a script"),
    ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1. Received: 0"),
    ({"min_nodes": 2, "max_nodes": 1}, "max_nodes must be >= min_nodes"),
    ({"node_rank": 2, "min_nodes": 2, "max_nodes": 2}, "--node-rank must be < --nnodes"),
    ({"master_port": 70000}, "--master-port must be in 1..65535"),
    ({"monitor_interval_s": 0}, "--monitor-interval must be > 0"),
    ({"max_restarts": -1}, "max_restarts must be an integer >= 0"),
    ({"module": True, "no_python": True}, "exclude each other"),
    ({"strategy": "nope"}, "Unknown strategy"),
    ({"strategy": "mirrored", "num_ps": 1, "nproc_per_node": 2}, "--num-ps only applies to strategies with parameter servers"),
    ({"strategy": "ps", "num_ps": 0, "nproc_per_node": 2}, "needs at least one parameter server"),
    ({"strategy": "ps", "num_ps": 2, "nproc_per_node": 2}, "leaves no worker"),
    ({"strategy": "ps", "nproc_per_node": 1}, "leaves no worker"),
    ({"num_ps": -1}, "--num-ps must be an integer >= 0"),
    ({"strategy": "one_device", "nproc_per_node": 2}, "one_device trains one replica"),
])
def test_spec_validation_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        spec(**kwargs)
    assert "Received" in str(err.value) or "Use" in str(err.value) or "Drop" in str(err.value)


def test_num_ps_and_strategy_defaults():
    assert (spec().strategy, spec().num_ps) == (None, 0)
    assert (spec(strategy="parameter_server", nproc_per_node=3).strategy,
            spec(strategy="parameter_server", nproc_per_node=3).num_ps) == ("ps", 1)
    implied = spec(num_ps=2, nproc_per_node=2, min_nodes=2, max_nodes=2)
    assert (implied.strategy, implied.num_ps, implied.min_world_size) == ("ps", 2, 4)


def test_worker_environment():
    s = spec(nproc_per_node=2, strategy="ps", num_ps=1)
    logs = {"TOWERS_LOG_LEVEL": "INFO"}  # the workers' [rank r/w] output
    assert s.worker_environment({}, cores=8) == {"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1", "OMP_NUM_THREADS": "4", **logs}
    assert s.worker_environment({"OMP_NUM_THREADS": "3", "TOWERS_LOG_LEVEL": "DEBUG"}, cores=8) == {
        "TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"}
    assert spec(nproc_per_node=4).worker_environment({}, cores=2) == {"OMP_NUM_THREADS": "1", **logs}


def test_command():
    assert spec(script_args=("--lr", "1")).command() == ["python", "-u", "train.py", "--lr", "1"]
    assert spec(script="pkg.train", module=True).command() == ["python", "-u", "-m", "pkg.train"]
    assert spec(script="./run.sh", no_python=True).command() == ["./run.sh"]


# --- command-line parsing (torchrun's parser + ours) -------------------------------------------
def test_parse_launch_args_accepts_torchrun_flags():
    s = parse_launch_args(
        ["--nproc-per-node", "2", "--nnodes", "1:3", "--node-rank", "0", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "head:29400", "--rdzv-id", "job7", "--max-restarts", "2", "--monitor-interval", "0.2",
         "--log-dir", "/tmp/logs", "--strategy", "parameter_server", "--num-ps", "1", "train.py", "--epochs", "3"],
        gpu_count=0, cpu_count=2)
    assert (s.nproc_per_node, s.min_nodes, s.max_nodes, s.rdzv_backend, s.rdzv_endpoint, s.rdzv_id) == (
        2, 1, 3, "c10d", "head:29400", "job7")
    assert (s.max_restarts, s.monitor_interval_s, s.strategy, s.num_ps) == (2, 0.2, "ps", 1)
    assert (s.script, s.script_args) == ("train.py", ("--epochs", "3"))
    assert s.torchrun_options["log_dir"] == "/tmp/logs"


def test_parse_launch_args_defaults_and_module():
    s = parse_launch_args(["--nproc_per_node=cpu", "-m", "pkg.train"], gpu_count=0, cpu_count=2)
    assert (s.nproc_per_node, s.module, s.monitor_interval_s, s.master_port) == (2, True, 0.5, None)
    standalone = parse_launch_args(["--standalone", "t.py"], gpu_count=0, cpu_count=2)
    assert (standalone.rdzv_backend, standalone.rdzv_endpoint) == ("c10d", "localhost:0")


# --- ports and pre-start checks ---------------------------------------------------------------
def test_resolve_ports_picks_free_loopback_port_on_one_node_only():
    assert resolve_ports(spec()).master_port is not None
    assert resolve_ports(spec(min_nodes=2, max_nodes=2)).master_port == 29500
    assert resolve_ports(spec(master_port=1234)).master_port == 1234
    assert resolve_ports(spec(rdzv_backend="c10d", rdzv_endpoint="h:1")).master_port is None


def test_preflight_missing_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError, match="Training script not found: 'missing.py'") as err:
        preflight(spec(script="missing.py"))
    assert err.value.exit_code == 2
    with pytest.raises(LaunchError, match="no such executable"):
        preflight(spec(script="no-such-binary-xyz", no_python=True))
    with pytest.raises(LaunchError, match="dotted module name"):
        preflight(spec(script="pkg/train.py", module=True))
    (tmp_path / "train.py").write_text("print(1)\n")
    preflight(spec(script="train.py", master_port=None))


def test_preflight_port_in_use(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"Port {port} on 127.0.0.1 is already in use"):
            preflight(spec(script=str(script), master_port=port))


def test_cli_reports_missing_script_without_starting(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--nproc-per-node", "2", "absent.py"]) == 2
    assert "Training script not found: 'absent.py'" in capsys.readouterr().err
    assert main(["launch", "--strategy", "ps", "--num-ps", "2", "--nproc-per-node", "2", "absent.py"]) == 2
    assert "leaves no worker" in capsys.readouterr().err


# --- the failure report -----------------------------------------------------------------------
def _failure(local_rank, exitcode, timestamp=100, pid=10, message="To enable traceback see: ..."):
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, timestamp=timestamp, pid=pid, message=message)


def test_failure_report_names_the_cause_not_the_ranks_we_stopped():
    # torchrun's agent notes the failure it saw first, then the ranks it stopped (SIGTERM), in that order.
    exc = SimpleNamespace(failures={1: _failure(1, 3), 0: _failure(0, -signal.SIGTERM)})
    error = _failure_error(exc, spec(nproc_per_node=2))
    assert str(error).startswith("rank 1 (local rank 1, pid 10) exited with code 3")
    assert "rank 0 was killed by SIGTERM" in str(error)
    assert (error.exit_code, error.failed_rank) == (3, 1)


def test_failure_report_names_the_first_failure_when_it_was_a_signal():
    # SIGTERM sent to the ps task (rank 2) ends the job: the agent stops the workers with SIGTERM too, and one of
    # them exits with code 1 on its way out (a lost peer). The first noted is the cause, whatever the others did.
    exc = SimpleNamespace(failures={2: _failure(2, -signal.SIGTERM, pid=12), 0: _failure(0, -signal.SIGTERM),
                                    1: _failure(1, 1)})
    error = _failure_error(exc, spec(nproc_per_node=3))
    assert str(error).startswith("rank 2 (local rank 2, pid 12) was killed by SIGTERM"), str(error)
    assert "(rank 0 was killed by SIGTERM, rank 1 exited with code 1)" in str(error)
    assert (error.exit_code, error.failed_rank) == (128 + signal.SIGTERM, 2)


def test_failure_report_for_a_killed_worker():
    exc = SimpleNamespace(failures={2: _failure(0, -signal.SIGKILL, message="oom")})
    error = _failure_error(exc, spec())
    assert "rank 2" in str(error) and "SIGKILL" in str(error) and "oom" in str(error)
    assert error.exit_code == 128 + signal.SIGKILL


# --- join timeout and the rendezvous address ---------------------------------------------------------
def test_join_timeout_flag_reaches_the_workers_and_torchruns_rendezvous():
    from towers.launch.nodes import rendezvous_timeouts

    parsed = parse_launch_args(["--nproc-per-node", "2", "--join-timeout", "45", "train.py"], gpu_count=0, cpu_count=4)
    assert parsed.join_timeout_s == 45.0
    assert parsed.worker_environment({"OMP_NUM_THREADS": "1"})["TOWERS_JOIN_TIMEOUT_S"] == "45"
    assert "TOWERS_JOIN_TIMEOUT_S" not in spec().worker_environment({"OMP_NUM_THREADS": "1"})
    assert rendezvous_timeouts(parsed, 45.0) == {"timeout": 45}
    assert rendezvous_timeouts(spec(rdzv_backend="c10d", rdzv_endpoint="h:1"), 9.6) == {"join_timeout": 10}
    kept = spec(torchrun_options={"rdzv_conf": "timeout=7"})
    assert rendezvous_timeouts(kept, 45.0) == {}  # the user's --rdzv-conf wins
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="--join-timeout must be a number of seconds > 0"):
            spec(join_timeout_s=bad)


@pytest.mark.parametrize("kwargs, expected", [
    ({"master_addr": "10.0.0.1", "master_port": 29500}, ("10.0.0.1", 29500, "--master-addr/--master-port")),
    ({"rdzv_endpoint": "host0:29501"}, ("host0", 29501, "--rdzv-endpoint")),
    ({"rdzv_endpoint": "[::1]:29502"}, ("::1", 29502, "--rdzv-endpoint")),
    ({"rdzv_endpoint": "host0", "rdzv_backend": "c10d"}, ("host0", 29400, "--rdzv-endpoint")),
])
def test_rendezvous_address(kwargs, expected):
    from towers.launch.nodes import rendezvous_address

    assert rendezvous_address(spec(max_nodes=2, min_nodes=2, **kwargs)) == expected


def test_a_bad_join_timeout_variable_is_a_usage_error(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setenv("TOWERS_JOIN_TIMEOUT_S", "soon")
    assert main(["launch", "--nproc-per-node", "1", str(script)]) == 2
    assert "TOWERS_JOIN_TIMEOUT_S must be a number of seconds > 0. Received: TOWERS_JOIN_TIMEOUT_S='soon'" in \
        capsys.readouterr().err


def test_only_strategies_that_survive_a_dead_worker_tolerate_one_by_default():
    assert spec(nproc_per_node=3, strategy="ps", num_ps=1).tolerate_worker_failures
    hybrid = spec(nproc_per_node=3, strategy="hybrid", num_ps=1)  # its dense all-reduce needs every worker
    assert hybrid.num_ps == 1 and not hybrid.tolerate_worker_failures
    with pytest.raises(ValueError, match="only applies to --strategy ps"):
        spec(nproc_per_node=3, strategy="hybrid", num_ps=1, tolerate_worker_failures=True)
