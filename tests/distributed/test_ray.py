"""An unchanged towers script under Ray Train: the README's loop inside ``TorchTrainer`` gives the bits ``towers launch``
gives for the same strategy and process count, on Ray's process group (never a second one).

One local Ray cluster of CPU workers (``ray.init(num_cpus=4)``) serves the whole module: Ray starts in seconds but
not in milliseconds, and CI has two cores. Each scenario runs ``tests/ray_job.py``'s functions in Ray's workers
(through ``towers.ray.train_loop``) and the same file under ``towers launch``, and compares the exported weights
with ``torch.equal``; the one-process run is the reference within the suite's tolerance. The cluster is shut down
at the end and none of Ray's processes may outlive it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cli_support import kill, processes_running, run, towers_command

ray = pytest.importorskip("ray", reason="Ray Train is not installed: pip install 'towers[ray]'")
ray_train = pytest.importorskip("ray.train")
from ray.train.torch import TorchTrainer  # noqa: E402

import towers.ray  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ray_job  # noqa: E402

pytestmark = pytest.mark.timeout(900)

JOB = Path(ray_job.__file__).resolve()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE_S = 180
#: One process against N replicas: float32 sums of the same gradients in another order, over 46 Adam steps.
ATOL = 1e-4


@pytest.fixture(scope="module")
def cluster() -> Any:
    """One local Ray cluster for the module, in a temporary directory of its own; nothing of it left after."""
    temp = tempfile.mkdtemp(prefix="towers-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a test cluster reports nothing anywhere
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{JOB.parent}:{EXAMPLES}"}})
    try:
        yield Path(temp)
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 20
        while processes_running(temp) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_running(temp)
        kill(left)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes outlived ray.shutdown(): {left}"


def _ray(cluster: Path, tmp_path: Path, job: str, strategy: str, workers: int, *, max_failures: int = 0,
         **config: Any) -> tuple[dict[str, torch.Tensor], Any]:
    out = tmp_path / f"ray-{job}-{strategy}-{workers}.pt"
    trainer = TorchTrainer(
        towers.ray.train_loop(ray_job.ray_entry),
        train_loop_config={"job": job, "strategy": strategy, "out": str(out), **config},
        scaling_config=ray_train.ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=ray_train.RunConfig(storage_path=str(tmp_path / "ray-storage"), name=f"{job}-{strategy}-{workers}",
                                       failure_config=ray_train.FailureConfig(max_failures=max_failures)))
    result = trainer.fit()
    assert result.error is None, result.error
    return torch.load(out, weights_only=True), result


def _starts(tmp_path: Path, job: str, strategy: str, workers: int) -> list[int]:
    """The steps each attempt of a Ray run started at (the job's chief notes them)."""
    text = (tmp_path / f"ray-{job}-{strategy}-{workers}.pt.starts").read_text()
    return [int(line) for line in text.split()]


def _launch(tmp_path: Path, job: str, launch: list[str], *args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"launch-{job}-{'-'.join(launch)}.pt"
    command = [sys.executable, str(JOB)] if not launch else [*towers_command(), "launch", *launch, str(JOB)]
    done = run([*command, job, str(out), *args], cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(tmp_path))
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return torch.load(out, weights_only=True)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    different = {k: (got[k] - want[k]).abs().max().item() for k in want if not torch.equal(got[k], want[k])}
    assert not different, f"not bit for bit: largest difference per tensor {different}"


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= ATOL, worst


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The README script with plain ``python``: one replica, the reference."""
    return _launch(tmp_path_factory.mktemp("one"), "readme", [])


#: strategy -> (Ray workers, towers launch arguments)
SCENARIOS = {
    "mirrored": (2, ["--nproc-per-node", "2", "--strategy", "mirrored"]),
    "ps": (3, ["--nproc-per-node", "3", "--strategy", "ps", "--num-ps", "1", "--strategy-option", "mode=sync"]),
    "sharded": (2, ["--nproc-per-node", "2", "--strategy", "sharded"]),
    "hybrid": (3, ["--nproc-per-node", "3", "--strategy", "hybrid", "--num-ps", "1", "--strategy-option", "mode=sync"]),
    "tp=2": (2, ["--nproc-per-node", "2", "--strategy", "sharded", "--mesh", "tp=2"]),
}
#: scenario -> the variables the user gives Ray's workers (``runtime_env``) to choose the strategy from outside
FROM_OUTSIDE = {"sharded": {"TOWERS_STRATEGY": "sharded"},
                "tp=2": {"TOWERS_STRATEGY": "sharded", "TOWERS_STRATEGY_OPTIONS": json.dumps({"mesh": "tp=2"})}}


@pytest.mark.parametrize("strategy", list(SCENARIOS))
def test_the_readme_script_under_ray_gives_towers_launchs_bits(cluster, tmp_path, one_process, strategy):
    workers, launch = SCENARIOS[strategy]
    # Sharded and the tp mesh are chosen from outside, as `towers launch` does: strategy_from_env() in the workers.
    config = {"env": FROM_OUTSIDE[strategy]} if strategy in FROM_OUTSIDE else {}
    under_ray, _ = _ray(cluster, tmp_path, "readme", "env" if config else strategy, workers, **config)
    launched = _launch(tmp_path, "readme", launch)
    _assert_equal(under_ray, launched)
    _assert_close(under_ray, one_process)


def test_a_worker_killed_mid_epoch_resumes_from_rays_checkpoint_and_ends_as_the_uninterrupted_run(cluster, tmp_path):
    """Rank 1 dies at step 12 (os._exit, no goodbye) on the first attempt; FailureConfig(max_failures=1) starts the
    group again, which resumes from ray.train.get_checkpoint() (towers' checkpoint of step 10, reported to Ray)."""
    marker = tmp_path / "killed-once"
    resumed, result = _ray(cluster, tmp_path, "resumable", "mirrored", 2, max_failures=1,
                           ckpt=str(tmp_path / "ckpt-ray"), kill_marker=str(marker))
    assert marker.exists(), "the worker was not killed: nothing was resumed"
    # The second attempt began at a checkpoint Ray registered: step 10's, or step 5's when Ray's controller had not
    # yet taken the report of step 10 (it polls the workers) when the worker died two steps later.
    first, second = _starts(tmp_path, "resumable", "mirrored", 2)
    assert first == 0 and second in (5, 10), (first, second)
    assert result.checkpoint is not None and result.metrics["step"] == 45, result.metrics
    uninterrupted = _launch(tmp_path, "resumable", SCENARIOS["mirrored"][1], "--ckpt", str(tmp_path / "ckpt-launch"))
    _assert_equal(resumed, uninterrupted)


def test_fit_under_ray_reports_the_chiefs_epoch_logs_resumes_from_rays_checkpoint_and_gives_towers_launchs_bits(
        cluster, tmp_path):
    """Rank 1 dies in the second epoch; the restarted group backs up to a fresh folder, which RayReport fills from
    Ray's checkpoint of the first epoch, so BackupAndRestore resumes there."""
    marker = tmp_path / "killed-once"
    under_ray, result = _ray(cluster, tmp_path, "fit", "mirrored", 2, max_failures=1, kill_marker=str(marker))
    assert marker.exists(), "the worker was not killed: nothing was resumed"
    assert _starts(tmp_path, "fit", "mirrored", 2) == [0, 23]  # the second attempt began after epoch 1 (23 steps)
    assert result.checkpoint is not None and (Path(result.checkpoint.path) / "state.pt").exists(), result.checkpoint
    assert result.metrics["epoch"] == ray_job.EPOCHS, result.metrics
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "examples_per_second"):
        assert isinstance(result.metrics.get(key), float), (key, result.metrics)
    _assert_equal(under_ray, _launch(tmp_path, "fit", SCENARIOS["mirrored"][1]))


def test_a_run_resumed_at_another_worker_count_trains_every_example_once(cluster, tmp_path):
    """One epoch: 3 workers stop from step 12 of 23 on (a backup every 5 steps), 2 workers resume from the backup: the
    ledger both runs kept proves every example trained exactly once (``towers verify --ledger``)."""
    ledger, backup = tmp_path / "run", str(tmp_path / "backup")
    job = {"env": {"TOWERS_LEDGER_DIR": str(ledger)}, "backup_dir": backup, "epochs": 1}
    _ray(cluster, tmp_path, "fit", "mirrored", 3, stop_at=12, **job)
    _ray(cluster, tmp_path, "fit", "mirrored", 2, **job)
    proved = run([*towers_command(), "verify", "--ledger", str(ledger)], cwd=tmp_path, deadline_s=60)
    assert proved.returncode == 0, proved.stdout + proved.stderr
    # The stop takes effect at the next step whose logs are reduced; the 2 workers go on mid-epoch from its backup.
    resumed = re.search(r"restored to epoch 0, example (\d+) of its order \(2 process\(es\)\)", proved.stdout)
    assert resumed and 0 < int(resumed.group(1)) < 1438, proved.stdout
    assert "every example of every completed epoch trained exactly once" in proved.stdout, proved.stdout


def test_the_example_driver_trains_reports_and_checkpoints(cluster, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import ray_train  # examples/ray_train.py, importable in Ray's workers too (PYTHONPATH above)

    metrics = ray_train.main(["--workers", "2", "--epochs", "1", "--storage", str(tmp_path)])
    assert metrics["epoch"] == 1 and 0 < metrics["loss"] < 3, metrics


def test_parameter_servers_report_checkpoints_to_ray_and_resume_after_a_lost_worker(cluster, tmp_path):
    """The ps task is a Ray worker that serves in its constructor: its part in every ray.train.report is made by
    towers.ray.train_loop while it serves. Worker 1 dies at step 12; the group restarts and resumes (ps state
    included) from Ray's checkpoint of step 10, to the uninterrupted towers launch run's bits."""
    marker = tmp_path / "killed-once"
    resumed, result = _ray(cluster, tmp_path, "resumable", "ps", 3, max_failures=1, ckpt=str(tmp_path / "ckpt-ray"),
                           kill_marker=str(marker))
    assert marker.exists() and result.metrics["step"] == 45, result.metrics
    first, second = _starts(tmp_path, "resumable", "ps", 3)
    assert first == 0 and second in (5, 10), (first, second)
    uninterrupted = _launch(tmp_path, "resumable", SCENARIOS["ps"][1], "--ckpt", str(tmp_path / "ckpt-launch"))
    _assert_equal(resumed, uninterrupted)
