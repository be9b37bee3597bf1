"""``towers verify`` without processes: the comparison, the cause catalogue on synthetic captures, the capture hook.

Each synthetic capture is what a faulty script's run records (parameters per update, examples per
update, the model's BatchNorm layers); the catalogue must name the fault and nothing else.
"""

from __future__ import annotations

import pytest
import torch

from towers import verify_capture
from towers.cluster import from_env
from towers.verify import VerifySpec, name_cause
from towers.verify.compare import Capture, delta_ratio, first_difference, gather_evidence, load_capture
from towers.verify.jobs import format_args

NAMES = ["w", "b"]


def _sgd_run(*, grad_scale: float = 1.0, steps: int = 3, init_shift: float = 0.0, change_at: int | None = None,
             seed: int = 0) -> list[list[torch.Tensor]]:
    """Parameters of a tiny SGD run: the update is ``grad_scale`` x the gradient (from update ``change_at`` on)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(4, 3, generator=g) + init_shift, torch.randn(3, generator=g)]
    grads = torch.Generator().manual_seed(7)
    out = [[p.clone() for p in params]]
    for update in range(1, steps + 1):
        scale = grad_scale if change_at is None or update >= change_at else 1.0
        noise = [torch.randn(p.shape, generator=grads) for p in params]
        params = [p - 0.1 * scale * n for p, n in zip(params, noise)]
        out.append([p.clone() for p in params])
    return out


def _capture(steps: list[list[torch.Tensor]], examples: list[int], **extra) -> Capture:
    return Capture(names=NAMES, steps=steps, observed=[{"examples": e, **extra} for e in examples])


def _cause(reference: Capture, ranks: list[Capture], *, error: str | None = None) -> str | None:
    cause = name_cause(gather_evidence(reference, ranks, replicas=len(ranks), error=error))
    return cause.key if cause is not None else None


REFERENCE = _capture(_sgd_run(), [32, 32, 32])


def test_the_same_run_has_no_difference_and_no_cause():
    ranks = [_capture(_sgd_run(), [16, 16, 16]), _capture(_sgd_run(), [16, 16, 16])]
    evidence = gather_evidence(REFERENCE, ranks, replicas=2, error=None)
    assert evidence.difference is None and evidence.replica_drift_step is None
    assert name_cause(evidence) is None


def test_rounding_is_not_a_difference():
    noisy = [[p + 1e-7 * torch.ones_like(p) for p in step] for step in _sgd_run()]
    assert first_difference(_sgd_run(), noisy, NAMES) is None


def test_first_difference_names_the_step_and_the_tensor():
    changed = _sgd_run(grad_scale=2.0, change_at=2)
    diff = first_difference(_sgd_run(), changed, NAMES)
    assert diff is not None and diff.step == 2 and diff.tensor in NAMES and diff.relative > 1e-2


def test_delta_ratio_measures_the_update_not_the_parameters():
    ratio, cosine = delta_ratio(_sgd_run(), _sgd_run(grad_scale=2.0), 1)
    assert ratio == pytest.approx(2.0) and cosine == pytest.approx(1.0)


@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_an_update_n_times_or_1_over_n_is_the_loss_normalisation(scale):
    run = _sgd_run(grad_scale=scale)
    assert _cause(REFERENCE, [_capture(run, [16, 16, 16]), _capture(run, [16, 16, 16])]) == "loss-scale"


def test_a_refused_per_replica_mean_is_named_from_the_error_text():
    error = ("[rank0]: ValueError: The loss backpropagated in this update did not come from "
             "towers.compute_average_loss, and 2 replicas SUM their gradients: a per-replica mean loss ...")
    assert _cause(REFERENCE, [None, None], error=error) == "loss-not-global"


def test_a_refused_unprepared_model_is_named_from_the_error_text():
    error = "RuntimeError: optimizer.step() ran, but the model returned by strategy.prepare was not called since ..."
    assert _cause(REFERENCE, [None, None], error=error) == "not-prepared-model"


def test_different_initial_weights_are_the_seeding():
    run = _sgd_run(seed=3)
    assert _cause(REFERENCE, [_capture(run, [16, 16, 16]), _capture(run, [16, 16, 16])]) == "unseeded-init"


def test_replicas_that_drift_apart_did_not_sum_their_gradients():
    ranks = [_capture(_sgd_run(grad_scale=0.7), [16, 16, 16]), _capture(_sgd_run(grad_scale=1.3), [16, 16, 16])]
    assert _cause(REFERENCE, ranks) == "replicas-drift"


def test_each_replica_reading_the_whole_batch_is_told_apart_from_the_loss_scale():
    run = _sgd_run(grad_scale=2.0)  # the same N x update as a per-replica normalisation: the examples tell them apart
    assert _cause(REFERENCE, [_capture(run, [32, 32, 32]), _capture(run, [32, 32, 32])]) == "whole-batch"


def test_a_gradient_hook_on_parameters_is_a_clip_before_the_sum():
    run = _sgd_run(grad_scale=2.0)
    ranks = [_capture(run, [16, 16, 16], grad_hooks=2), _capture(run, [16, 16, 16], grad_hooks=2)]
    assert _cause(REFERENCE, ranks) == "clip-before-final"


def test_unsynchronised_batchnorm_is_named_when_the_run_differs():
    run = _sgd_run(grad_scale=1.2)
    ranks = [_capture(run, [16, 16, 16]), _capture(run, [16, 16, 16])]
    for capture in ranks:
        capture.unsynced_batchnorm = ["1"]
    assert _cause(REFERENCE, ranks) == "batchnorm-unsynced"
    same = [_capture(_sgd_run(), [16, 16, 16]), _capture(_sgd_run(), [16, 16, 16])]
    same[0].unsynced_batchnorm = ["1"]
    assert _cause(REFERENCE, same) is None  # BatchNorm alone is no fault


def test_a_last_batch_split_otherwise_is_the_uneven_last_batch():
    reference = _capture(_sgd_run(), [16, 16, 3])
    run = _sgd_run(grad_scale=1.3, change_at=3)
    ranks = [_capture(run, [8, 8, 2]), _capture(run, [8, 8, 2])]
    assert _cause(reference, ranks) == "uneven-last-batch"


def _with_rows(steps: list[list[torch.Tensor]], rows: list[list[str]]) -> Capture:
    """A capture whose update ``u`` trained the examples fingerprinted ``rows[u - 1]``."""
    return Capture(names=NAMES, steps=steps, observed=[{"examples": len(r), "rows": r} for r in rows])


def _ids(first: int, n: int) -> list[str]:
    return [f"example{i}" for i in range(first, first + n)]


ROWS_REFERENCE = _with_rows(_sgd_run(), [_ids(0, 16), _ids(16, 16), _ids(32, 16)])


def test_replicas_that_read_the_same_examples_are_named():
    run = _sgd_run(grad_scale=1.3)  # no DistributedSampler: both read examples 0..7, then 8..15, ...
    same = [_ids(0, 8), _ids(8, 8), _ids(16, 8)]
    assert _cause(ROWS_REFERENCE, [_with_rows(run, same), _with_rows(run, same)]) == "same-examples"


def test_replicas_that_draw_their_own_random_batches_are_named():
    run = _sgd_run(grad_scale=1.3)  # nanoGPT: rank 0 draws from the one process's seed, rank 1 from its own
    ranks = [_with_rows(run, [_ids(0, 8), _ids(16, 8), _ids(32, 8)]),
             _with_rows(run, [_ids(900, 8), _ids(908, 8), _ids(916, 8)])]
    assert _cause(ROWS_REFERENCE, ranks) == "own-random-batches"


def test_replicas_that_share_one_processs_examples_are_neither():
    run = _sgd_run(grad_scale=1.2)  # each takes its half of one process's batch: the data is right
    ranks = [_with_rows(run, [_ids(0, 8), _ids(16, 8), _ids(32, 8)]),
             _with_rows(run, [_ids(8, 8), _ids(24, 8), _ids(40, 8)])]
    for capture in ranks:
        capture.unsynced_batchnorm = ["1"]
    assert _cause(ROWS_REFERENCE, ranks) == "batchnorm-unsynced"


def test_script_arguments_are_filled_per_world_size():
    assert format_args(["--batch-size", "{64 // world_size}", "--n={world_size}", "{not ours}"], 4) == (
        "--batch-size", "16", "--n=4", "{not ours}")
    with pytest.raises(ValueError, match="whole number"):
        format_args(["{10 / world_size}"], 3)


def test_the_spec_refuses_what_cannot_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match="Python script"):
        VerifySpec(script=str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="2 or more"):
        VerifySpec(script=str(script), replicas=(1,))
    with pytest.raises(ValueError, match="positive"):
        VerifySpec(script=str(script), steps=0)


def test_the_cluster_description_carries_the_capture_directory():
    info = from_env({"TOWERS_VERIFY_DIR": "/tmp/x", "TOWERS_VERIFY_STEPS": "4"})
    assert (info.verify_dir, info.verify_steps) == ("/tmp/x", 4)
    assert from_env({}).verify_dir is None


def test_the_hook_records_each_update_and_stops_the_script_after_k(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    capture = verify_capture._Capture(str(tmp_path), steps=2, rank=0)
    monkeypatch.setattr(verify_capture, "_capture", [capture])  # what from_env would give under towers verify
    verify_capture.add_observer(lambda: {"examples": 5})
    expected = []
    with pytest.raises(SystemExit) as stopped:
        for _ in range(5):
            model(torch.randn(5, 3)).sum().backward()
            expected.append([p.detach().clone() for p in model.parameters()])
            verify_capture.before_update(optimizer)  # what the prepared optimizer's step does first
            optimizer.step()
    assert stopped.value.code == 0 and len(expected) == 3  # stopped before the third update
    recorded = load_capture(str(tmp_path / "rank0"))
    assert recorded is not None and recorded.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert recorded.unsynced_batchnorm == ["1"]
    assert recorded.observed == [{"examples": 5}] * 3
    for ours, theirs in zip(recorded.steps, expected):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_outside_verify_the_hook_does_nothing(monkeypatch):
    monkeypatch.setattr(verify_capture, "_capture", [None])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    for _ in range(10):
        verify_capture.before_update(optimizer)
