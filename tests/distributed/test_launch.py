"""`towers launch` end to end: the real command in a new session, a deadline, and no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from cli_support import OutputReader, clean_env, kill, processes_running, run, towers_command

from towers.launch import cpu_threads_per_process

pytestmark = pytest.mark.timeout(180)

DEADLINE_S = 90.0


def run_launch(args: list[str], script: Path, *, deadline_s: float = DEADLINE_S) -> tuple[int, str, str, float]:
    """Run ``towers launch ARGS SCRIPT`` as a user would; return (exit code, stdout, stderr, end time)."""
    result = run([*towers_command(), "launch", *args, str(script)], cwd=script.parent, deadline_s=deadline_s,
                 marker=str(script))
    return result.returncode, result.stdout, result.stderr, time.time()


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_two_processes_all_reduce_and_see_the_launch_environment(tmp_path):
    script = write_script(tmp_path, "allreduce.py", """
        import os
        import torch
        import torch.distributed as dist
        from towers import cluster
        from towers.process_group import init_process_group

        info = cluster.from_env()
        init_process_group(info, backend="gloo", timeout_s=60)
        value = torch.tensor([float(info.rank)])
        dist.all_reduce(value)
        print(f"rank={info.rank} sum={int(value.item())} world={info.world_size} local={info.local_rank} "
              f"chief={info.is_chief} strategy={info.strategy} omp={os.environ.get('OMP_NUM_THREADS')} "
              f"source={info.source}", flush=True)
        dist.destroy_process_group()
    """)
    code, out, err, _ = run_launch(["--nproc-per-node", "2", "--monitor-interval", "0.2", "--strategy", "mirrored"],
                                   script)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    threads = cpu_threads_per_process(2)
    for rank in (0, 1):
        expected = (f"rank={rank} sum=1 world=2 local={rank} chief={rank == 0} strategy=mirrored omp={threads} "
                    "source=torchrun")
        assert expected in out, f"missing {expected!r} in:\n{out}\nstderr:\n{err}"
    # The script reads the job's layout but never builds a towers strategy: --strategy mirrored went unused.
    unused = [line for line in err.splitlines() if "--strategy mirrored was not used" in line]
    assert len(unused) == 1 and "Call towers.strategy_from_env() in the script" in unused[0], err


def test_a_failing_rank_stops_the_job_and_is_named(tmp_path):
    # Rank 1 exits with code 3 right after the rendezvous; rank 0 waits in a barrier and, when the
    # barrier breaks, stays stuck on purpose: only the launcher can end it.
    script = write_script(tmp_path, "fails.py", """
        import os, sys, time
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo")
        if rank == 1:
            print(f"rank 1 exits at {time.time()}", flush=True)
            sys.exit(3)
        try:
            dist.barrier()
        except Exception:
            pass
        print("rank 0 is stuck", flush=True)
        time.sleep(600)
    """)
    code, out, err, ended = run_launch(["--nproc-per-node", "2", "--monitor-interval", "0.2"], script)
    assert code == 3, f"stdout:\n{out}\nstderr:\n{err}"
    match = re.search(r"rank 1 exits at ([0-9.]+)", out)
    assert match, out
    assert ended - float(match.group(1)) < 15.0, "the launcher took too long to stop the job"
    assert "towers launch: rank 1 (local rank 1" in err and "exited with code 3" in err, err


def test_a_scripts_traceback_has_one_rank_prefix(tmp_path):
    # torch's excepthook would prefix every line of a traceback with "[rank1]: ", after the launcher's "[rank 1]: ".
    script = write_script(tmp_path, "raises.py", """
        import towers

        strategy = towers.MirroredStrategy(timeout_s=30)
        if strategy.replica_id == 1:
            raise ValueError("bad data in shard 7")
        strategy.barrier()
    """)
    code, out, err, _ = run_launch(["--nproc-per-node", "2", "--monitor-interval", "0.2"], script)
    assert code != 0
    assert "[rank 1]: ValueError: bad data in shard 7" in err.splitlines(), err
    assert "[rank1]:" not in err, err


def test_parameter_server_flags_reach_the_workers(tmp_path):
    script = write_script(tmp_path, "roles.py", """
        import os
        from towers import cluster

        info = cluster.from_env()
        print(f"rank={info.rank} task={info.task.type}:{info.task.index} strategy={info.strategy} "
              f"num_ps={info.num_ps} env={os.environ['TOWERS_STRATEGY']},{os.environ['TOWERS_NUM_PS']} "
              f"options={sorted(info.strategy_options.items())}", flush=True)
    """)
    code, out, err, _ = run_launch(
        ["--nproc-per-node", "2", "--monitor-interval", "0.2", "--strategy", "parameter_server", "--num-ps", "1",
         "--strategy-option", "mode=sync", "--strategy-option", "staleness=2"], script)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    options = "options=[('mode', 'sync'), ('staleness', 2)]"
    assert f"rank=0 task=worker:0 strategy=ps num_ps=1 env=ps,1 {options}" in out, out
    assert f"rank=1 task=ps:0 strategy=ps num_ps=1 env=ps,1 {options}" in out, out


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    # What Kubernetes or SLURM does on preemption: SIGTERM to the launcher, which must end its workers.
    script = write_script(tmp_path, "sleeps.py", """
        import os, sys, time
        # one write per line: unbuffered print() writes text and newline apart, and two ranks share the pipe
        sys.stdout.write(f"ready {os.environ['RANK']}\\n")
        sys.stdout.flush()
        time.sleep(600)
    """)
    proc = subprocess.Popen([*towers_command(), "launch", "--nproc-per-node", "2", "--monitor-interval", "0.2",
                             str(script)], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        output = OutputReader(proc)
        ready = {line.split()[3] for line in output.wait_for_lines(2, "[rank ", deadline_s=DEADLINE_S)}  # [rank R]: ready R
        assert ready == {"0", "1"}, f"workers did not start: {ready}"
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = output.collect(timeout_s=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "received SIGTERM and stopped every worker" in err, err
        assert processes_running(str(script)) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill(processes_running(str(script)))


def test_max_restarts_resumes_from_the_backup_with_the_uninterrupted_result(tmp_path):
    # Rank 1 dies at global step 7 of the first attempt; the launcher restarts the job, which resumes
    # from the step-6 backup and must end exactly where a run that never crashed ends. That run is
    # computed here on one device: Mirrored on 2 replicas is the same maths as one device.
    import torch

    body = """
        import os, sys
        import torch, torch.nn.functional as F
        from torch import nn
        import towers

        def build(strategy):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(96, 4, generator=g)
            torch.manual_seed(0)
            with strategy.scope():
                model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            return towers.Trainer(model, optimizer, F.cross_entropy, strategy=strategy), (x, (x[:, 0] > 0).long())

        if __name__ == "__main__":
            attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
            strategy = towers.strategy_from_env()
            trainer, data = build(strategy)

            class Crash(towers.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    if attempt == 0 and strategy.replica_id == 1 and logs["global_step"] == 7:
                        os._exit(3)

            backup = towers.callbacks.BackupAndRestore(sys.argv[1], save_freq=2)
            trainer.fit(data, epochs=2, global_batch_size=16, callbacks=[backup, Crash()])
            print(f"rank {strategy.replica_id} attempt {attempt} resumed_from {backup.restored_from} "
                  f"global_step {trainer.progress.global_step}", flush=True)
            if strategy.is_chief:
                torch.save(trainer.unwrapped_model.state_dict(), sys.argv[2])
    """
    script = write_script(tmp_path, "restarts.py", body)
    backup_dir, out_file = tmp_path / "backup", tmp_path / "final.pt"
    launch_args = ["--nproc-per-node", "2", "--monitor-interval", "0.2", "--max-restarts", "1", "--strategy", "mirrored"]
    result = run([*towers_command(), "launch", *launch_args, str(script), str(backup_dir), str(out_file)],
                 cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "was not used" not in err, err  # the script built the strategy --strategy named
    for rank in (0, 1):
        line = f"rank {rank} attempt 1 resumed_from {{'epoch': 0, 'step': 6, 'global_step': 6}} global_step 12"
        assert line in out, f"missing {line!r} in:\n{out}\nstderr:\n{err}"

    namespace: dict = {}
    exec(compile(textwrap.dedent(body), str(script), "exec"), namespace)  # build() without running __main__
    import towers

    reference, data = namespace["build"](towers.OneDeviceStrategy("cpu"))
    reference.fit(data, epochs=2, global_batch_size=16)
    final = torch.load(out_file, weights_only=True)
    for name, value in reference.unwrapped_model.state_dict().items():
        assert torch.allclose(final[name], value, atol=1e-5), name
