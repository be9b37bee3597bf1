"""bitwise=True: the seed CNN on the bundled digits with Adam trains the same bits at 1, 2, 3 and 4 replicas,
under MirroredStrategy and FullyShardedStrategy.

After 50 updates every parameter and every optimizer-state tensor is ``torch.equal`` to the one-process
run's, and the losses the loop logged (``strategy.reduce("sum", strategy.run(...))``) are equal floats;
with towers' clip and with torch's own. Without bitwise the same job at 3 replicas is only close (the
control: the test can tell). From outside: ``towers launch --bitwise`` on the unchanged script.
Every process runs with one intra-op thread (a CPU kernel's reduction may follow the thread count).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import towers
from cli_support import clean_env, run, towers_command
from towers.launch import SpawnError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bitwise_job import fit, train, train_dropout, train_gpt, train_habits  # noqa: E402

pytestmark = pytest.mark.timeout(420)
JOB = Path(__file__).resolve().parents[1] / "bitwise_job.py"
UPDATES = 50


def _differences(result: dict, reference: dict) -> list[str]:
    """The names of the tensors (and the losses) that are not bitwise equal."""
    bad = [k for k, v in reference["params"].items() if not torch.equal(result["params"][k], v)]
    bad += [f"optimizer[{i}].{k}" for i, state in reference["optimizer"].items() for k, v in state.items()
            if not torch.equal(result["optimizer"][i][k], v)]
    return bad + (["losses"] if result["losses"] != reference["losses"] else [])


@pytest.fixture(scope="module")
def one_process() -> dict:
    return towers.spawn(train, 1, args=(UPDATES,), timeout_s=120, threads_per_process=1)[0]


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_same_bits_as_one_process_at_any_replica_count(one_process, replicas):
    results = towers.spawn(train, replicas, args=(UPDATES,), timeout_s=240, threads_per_process=1)
    assert [r["replicas"] for r in results] == [replicas] * replicas
    assert len(one_process["losses"]) == UPDATES and one_process["losses"][-1] < one_process["losses"][0]  # it learns
    for rank, result in enumerate(results):
        assert _differences(result, one_process) == [], f"rank {rank} of {replicas}"


@pytest.mark.parametrize("replicas", [2, 3])
def test_sharded_has_the_same_bits_as_one_process(one_process, replicas):
    """FullyShardedStrategy (FSDP2): the tree summed inside its reduce-scatter, the clip's norm from the whole
    gradients; its parameters and Adam's state, gathered whole, are one process's bits."""
    results = towers.spawn(train, replicas, args=(UPDATES,), kwargs={"kind": "sharded"}, timeout_s=240,
                           threads_per_process=1)
    assert [_differences(r, one_process) for r in results] == [[]] * replicas


def test_sharded_keeps_the_bits_through_accumulation_and_an_empty_share_and_refuses_torchs_clip():
    reference = towers.spawn(train_habits, 1, args=(2, "sharded"), timeout_s=120, threads_per_process=1)[0]
    results = towers.spawn(train_habits, 3, args=(2, "sharded"), timeout_s=180, threads_per_process=1)
    for name in ("accumulate", "by_hand"):  # replicas with fewer micro-batches run extra ones: FSDP2's gathers match
        assert [_differences(r[name], reference[name]) for r in results] == [[], [], []], name
    with pytest.raises(SpawnError, match=r"under FullyShardedStrategy\(bitwise=True\) torch takes the norm "
                                                r"from each process's shards.*strategy.clip_grad_norm_"):
        towers.spawn(train, 2, args=(2,), kwargs={"kind": "sharded", "clip": "torch"}, timeout_s=120,
                     threads_per_process=1)


def test_preempted_at_two_replicas_and_resumed_at_three_it_ends_with_the_same_bits(one_process, tmp_path):
    kwargs = {"checkpoints": str(tmp_path / "ckpt")}
    towers.spawn(train, 2, args=(UPDATES,), kwargs={**kwargs, "stop_at": 20}, timeout_s=180, threads_per_process=1)
    resumed = towers.spawn(train, 3, args=(UPDATES,), kwargs=kwargs, timeout_s=180, threads_per_process=1)
    assert [(r["replicas"], r["resumed_at"]) for r in resumed] == [(3, 20)] * 3
    assert [_differences(r, one_process) for r in resumed] == [[], [], []]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])  # a bucket per parameter, a few, one for all
def test_the_bucketed_exchange_gives_the_trees_bits_whatever_order_the_gradients_finish_in(bucket_bytes):
    """Buckets start as their parameters' last gradients finish (each rank in another order here), always in one
    order on every rank; the tree's sum of every parameter is one process's, bit for bit, at 3 processes."""
    from bitwise_job import bucketed_exchange

    from towers.strategies._bitwise_tree import Grads, root_sum

    got = towers.spawn(bucketed_exchange, 3, args=(bucket_bytes,), timeout_s=120, threads_per_process=1)
    torch.manual_seed(0)
    shapes = ((5, 3), (7,), (2, 2, 3), (11,))
    leaves = {(0, leaf): Grads([torch.randn(s) * 10 ** float(torch.randint(-3, 3, ())) for s in shapes])
              for leaf in range(7)}
    want = root_sum(leaves, 7, lambda: Grads([torch.zeros(s) for s in shapes])).tensors
    assert all(len(totals) == 4 and all(torch.equal(a, b) for a, b in zip(totals, want)) for totals in got)


@pytest.fixture(scope="module")
def unclipped_one_process() -> dict:
    """One process without a clip: the parameter servers refuse a global-norm clip (a worker holds its share)."""
    return towers.spawn(train, 1, args=(UPDATES,), kwargs={"clip": "none"}, timeout_s=120, threads_per_process=1)[0]


@pytest.mark.parametrize("workers, num_ps", [(2, 1), (2, 2)])  # 3 workers: the GPT, fit and test_mirrored below
def test_parameter_servers_sum_the_tree_at_the_ps_and_train_one_process_bits(unclipped_one_process, workers, num_ps):
    """ParameterServerStrategy(mode="sync", bitwise=True), 2 workers and 1 or 2 ps tasks: each worker pushes its
    subtrees, each ps task sums the top of the tree for its shard and steps Adam with torch's own kernel; every worker
    ends with one process's parameters, the Adam state (fetched from the ps tasks) is one process's, and so are the
    logged losses."""
    results = towers.spawn(train, workers + num_ps, args=(UPDATES,),
                           kwargs={"clip": "none", "kind": "ps" if num_ps == 1 else "ps2"}, timeout_s=240,
                           threads_per_process=1)
    assert results[workers:] == [{}] * num_ps  # the ps tasks
    assert [_differences(r, unclipped_one_process) for r in results[:workers]] == [[]] * workers


def test_hybrid_sums_the_dense_tree_among_the_workers_and_trains_one_process_bits(one_process):
    """HybridStrategy(bitwise=True), 1 ps task + 3 workers, with towers' clip: the dense subtrees exchanged among
    the workers as MirroredStrategy does."""
    results = towers.spawn(train, 4, args=(UPDATES,), kwargs={"kind": "hybrid"}, timeout_s=240, threads_per_process=1)
    assert [_differences(r, one_process) for r in results[:-1]] == [[], [], []]


def test_a_ps_worker_killed_stops_the_job_by_name_and_the_restart_ends_with_one_process_bits(unclipped_one_process,
                                                                                           tmp_path):
    """``towers launch`` of 2 workers + 1 ps task under ``--bitwise``, saving every 10 updates; worker 1 dies after
    update 26 (no goodbye). A lost worker's micro-batches are in no one's tree, so the survivor does not train on
    (another sum) but stops with the reason and the fix; ``--max-restarts 1`` restarts the job, which resumes at
    update 20 and ends with the bits of one process that never lost anything."""
    argv = [*towers_command(), "launch", "--nproc-per-node", "3", "--num-ps", "1", "--bitwise", "--strategy-option",
            "mode=sync", "--strategy-option", "micro_batch_size=4", "--max-restarts", "1", str(JOB), str(tmp_path),
            str(UPDATES), str(tmp_path / "ckpt"), "26"]
    proc = run(argv, cwd=tmp_path, env={**clean_env(), "OMP_NUM_THREADS": "1"}, deadline_s=240, marker=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "under bitwise=True" in proc.stderr and "Restart the job from its last checkpoint" in proc.stderr, \
        proc.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["resumed_at"] == 20
    assert _differences(result, unclipped_one_process) == []


@pytest.fixture(scope="module")
def gpt_one_process() -> dict:
    return towers.spawn(train_gpt, 1, args=(UPDATES,), timeout_s=120, threads_per_process=1)[0]


def test_a_fault_tolerant_group_killed_and_healed_ends_with_one_process_bits(tmp_path):
    """Two replica groups under ``towers launch --strategy ft --bitwise``; group 1 SIGKILLs itself before step 5, the
    survivor retries the step alone (the same tree over fewer groups), the launcher restarts group 1, it heals from
    group 0 and both train on. Both end with the bits of one process that never lost anything."""
    pytest.importorskip("torchft", reason="the optional extra towers[ft] is not installed")
    from cli_support import OutputReader, kill, processes_running, start
    from ft_job import bitwise_reference, done_step

    job = Path(__file__).resolve().parents[1] / "ft_job.py"
    stop_file = tmp_path / "stop"
    argv = [*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "ft", "--bitwise", "--strategy-option",
            "micro_batch_size=4", "--strategy-option", "peer_timeout_s=1", str(job), "env", "-", str(stop_file),
            str(tmp_path), "--fail-group", "1", "--fail-at", "5", "--fail-how", "kill"]
    env = clean_env()
    env.pop("RUST_LOG", None)
    launcher = OutputReader(start(argv, cwd=tmp_path, env=env))
    try:
        assert launcher.wait_for_lines(1, "[rank 1]: failing", deadline_s=90), "".join(launcher._err[-40:])
        back = launcher.wait_for_lines(1, "[rank 1]: step", deadline_s=90)
        assert back and " groups 2 " in back[0], "".join(launcher._err[-40:])  # healed, training with both again
        stop_file.touch()
        out, err = launcher.collect(timeout_s=90)
        assert launcher.proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    finally:
        if launcher.proc.poll() is None:
            kill([launcher.proc.pid])
        leftovers = processes_running(str(tmp_path))
        kill(leftovers)
    assert not leftovers and "replica group 1 was restarted alone 1 time(s)" in err, err[-3000:]
    stop_at = done_step(out, 2)
    reference = towers.spawn(bitwise_reference, 1, args=(stop_at, 4), timeout_s=120, threads_per_process=1)[0]
    for group in (0, 1):
        final = torch.load(tmp_path / f"group{group}.pt", weights_only=True)
        assert [k for k, v in reference.items() if not torch.equal(final[k], v)] == [], (group, stop_at)


@pytest.mark.parametrize("kind, replicas", [("mirrored", 2), ("mirrored", 3), ("mirrored", 4), ("sharded", 3)])
def test_a_gpt_with_adamw_and_a_token_mask_has_the_same_bits_at_any_replica_count(gpt_one_process, kind, replicas):
    """50 updates. Mirrored: buckets of 4 KiB, so the exchange runs in many buckets, started during the last
    backward; sharded: every block an FSDP2 unit with its own tree."""
    results = towers.spawn(train_gpt, replicas, args=(UPDATES, kind, True, 4096), timeout_s=180, threads_per_process=1)
    assert gpt_one_process["losses"][-1] < gpt_one_process["losses"][0]
    assert [_differences(r, gpt_one_process) for r in results] == [[]] * replicas


def test_a_gpt_with_a_token_mask_has_one_process_bits_under_ps_and_hybrid_at_three_workers(gpt_one_process):
    """The weighted loss: the ps divides the tree's sum by the update's weight as one device divides its gradient
    (a worker's share was once divided in place before its push: a silent second division)."""
    hybrid = towers.spawn(train_gpt, 4, args=(UPDATES, "hybrid"), timeout_s=180, threads_per_process=1)
    assert [_differences(r, gpt_one_process) for r in hybrid[:-1]] == [[], [], []]
    unclipped = towers.spawn(train_gpt, 1, args=(UPDATES, "mirrored", False), timeout_s=120, threads_per_process=1)[0]
    ps = towers.spawn(train_gpt, 4, args=(UPDATES, "ps", False), timeout_s=180, threads_per_process=1)
    assert [_differences(r, unclipped) for r in ps[:-1]] == [[], [], []]


def test_dropout_masks_keyed_by_the_micro_batch_give_the_same_bits_at_three_replicas():
    reference = towers.spawn(train_dropout, 1, args=(12,), timeout_s=120, threads_per_process=1)[0]
    results = towers.spawn(train_dropout, 3, args=(12,), timeout_s=180, threads_per_process=1)
    assert all(_differences(r, reference) == [] for r in results)


def test_accumulation_and_an_epoch_ending_on_an_empty_share_keep_the_same_bits_at_three_replicas():
    """149 digits in batches of 48 end each epoch on 5 examples: micro-batches of 4 and 1, none for the third replica.
    Accumulated by towers (gradient_accumulation_steps=2) and by hand (the loop steps every second batch)."""
    reference = towers.spawn(train_habits, 1, args=(2,), timeout_s=120, threads_per_process=1)[0]
    results = towers.spawn(train_habits, 3, args=(2,), timeout_s=180, threads_per_process=1)
    for name in ("accumulate", "by_hand"):
        assert len(reference[name]["losses"]) == 8
        assert [_differences(r[name], reference[name]) for r in results] == [[], [], []], name


@pytest.mark.parametrize("kind", ["mirrored", "ps"])  # ps: 3 workers + 1 ps task, no clip (refused there)
def test_trainer_fit_has_the_same_bits_and_the_same_history_at_three_replicas(kind):
    reference = towers.spawn(fit, 1, args=(2, kind), timeout_s=120, threads_per_process=1)[0]
    results = towers.spawn(fit, 3 + (kind == "ps"), args=(2, kind), timeout_s=180, threads_per_process=1)
    for result in results[:3]:
        assert [k for k, v in reference["params"].items() if not torch.equal(result["params"][k], v)] == []
        assert (result["loss"], result["accuracy"]) == (reference["loss"], reference["accuracy"])


def test_torchs_own_clip_keeps_the_same_bits_and_plain_mirrored_does_not():
    reference = towers.spawn(train, 1, args=(10,), kwargs={"clip": "torch"}, timeout_s=120, threads_per_process=1)[0]
    bitwise = towers.spawn(train, 3, args=(10,), kwargs={"clip": "torch"}, timeout_s=120, threads_per_process=1)
    assert all(_differences(r, reference) == [] for r in bitwise)
    plain = towers.spawn(train, 3, args=(10,), kwargs={"clip": "torch", "bitwise": False}, timeout_s=120,
                         threads_per_process=1)
    close = max((plain[0]["params"][k] - v).abs().max().item() for k, v in reference["params"].items())
    assert _differences(plain[0], reference) and close < 1e-2  # the control: same maths, other bits


def test_towers_launch_bitwise_on_the_unchanged_script(tmp_path):
    reference = towers.spawn(train, 1, args=(10,), timeout_s=120, threads_per_process=1)[0]
    env = {**clean_env(), "OMP_NUM_THREADS": "1"}
    done = run([*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "mirrored", "--bitwise",
                "--strategy-option", "micro_batch_size=4", str(JOB), str(tmp_path), "10"],
               cwd=tmp_path, deadline_s=180, marker=str(JOB), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(os.path.join(tmp_path, "result.pt"), weights_only=True)
    assert result["replicas"] == 2 and _differences(result, reference) == []


def test_the_example_prints_one_digest_in_one_process_and_on_three_sharded_replicas(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "bitwise.py"
    alone = run([sys.executable, str(example)], cwd=tmp_path, deadline_s=120, marker=str(example), env=clean_env())
    sharded = run([*towers_command(), "launch", "--nproc-per-node", "3", "--strategy", "sharded", str(example)],
                  cwd=tmp_path, deadline_s=180, marker=str(example), env=clean_env())
    assert alone.returncode == 0 and sharded.returncode == 0, alone.stderr[-2000:] + sharded.stderr[-2000:]
    (one,) = [line.split("digest ")[1] for line in alone.stdout.splitlines() if "digest" in line]
    (three,) = [line.split("digest ")[1] for line in sharded.stdout.splitlines() if "digest" in line]
    assert "FullyShardedStrategy, 3 replica(s): 30 updates" in sharded.stdout and one == three


def test_towers_verify_bitwise_finds_the_same_bits_where_the_default_comparison_finds_rounding(tmp_path):
    argv = [*towers_command(), "verify", "--replicas", "2,3", "--steps", "4", "--bitwise", "4", str(JOB), "--",
            str(tmp_path), "6"]
    done = run(argv, cwd=tmp_path, deadline_s=240, marker=str(JOB), env=clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("mirrored", "sharded"))]
    assert [(r[0], r[1], r[-1]) for r in rows] == [(s, n, "same") for s in ("mirrored", "sharded") for n in "23"]
    assert all(r[-2] == "0.0e+00" for r in rows)
    assert "compared with torch.equal" in done.stdout
    rounding = run([*towers_command(), "verify", "--replicas", "3", "--steps", "4", "--strategies", "mirrored", str(JOB),
                    "--", str(tmp_path), "6"], cwd=tmp_path, deadline_s=240, marker=str(JOB), env=clean_env())
    (row,) = [line.split() for line in rounding.stdout.splitlines() if line.startswith("mirrored")]
    assert row[-1] == "same" and float(row[-2]) > 0  # without --bitwise: within the tolerance, not the same bits
