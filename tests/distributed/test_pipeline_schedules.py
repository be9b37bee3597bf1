"""Every pipeline schedule torch ships, by name, trains as the plain one-device loop does.

One spawn of 2 processes (``mesh="pp=2"``) runs each of the seven ``pp_schedule`` values in turn:
``1f1b`` and ``gpipe`` (one stage per process), ``interleaved_1f1b``, ``looped_bfs`` and
``interleaved_zero_bubble`` (stages r and r + 2 on process r), ``zbv_zero_bubble`` and ``dualpipe_v``
(stages r and 3 - r: a V, whose first and last stages are both on process 0). Each trains towers' GPT
(4 blocks: one per stage under the two-stage schedules) and an ``nn.Sequential`` for 3 updates of 4
micro-batches through ``strategy.forward_backward`` and ``strategy.clip_grad_norm_``; the reference is
the loop a user writes on one device without towers (the global batch's mean loss, torch's
``clip_grad_norm_``, SGD with momentum). Parameters match within rtol 1e-4 (every process gathers the
whole model, in the model's order), clip norms and losses within 1e-5, ``model(x)`` under
``torch.no_grad()`` returns the trained plain model's output on both processes, and the step's outputs
come back on the process holding the last stage only. The same spawn checks: a shape a schedule
cannot run falls back with a log line (DualPipeV on a last batch of 2 examples runs ZBV; interleaved
1F1B on 5 micro-batches runs LoopedBFS) and still trains as one device; a checkpoint written under
ZBV (two stages per process) restores into one plain process; ``Trainer.fit`` under DualPipeV, whose
losses are on process 0, gives one History everywhere and one device's parameters; the bubble is
logged at the first step and is ``strategy.pipeline_bubble_fraction``.

One spawn of 4 processes runs what differs with more processes: ``pp=2,dp=2`` (each process's two
stages sharded by FSDP2 over 2 replicas) under the two zero-bubble schedules and DualPipeV,
``pp=2,tp=2`` (both stages' layers split over tp) under interleaved 1F1B, and ``pp=4`` (8 stages of an
``nn.Sequential``) under the five two-stage schedules.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from gpt_support import token_loss as _token_loss
from towers.models_gpt import GPT, GPTConfig, random_tokens
from towers.parallel.pipeline_schedules import SCHEDULES

pytestmark = pytest.mark.timeout(240)

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16)
GBS, STEPS, CLIP, LR = 8, 3, 0.5, 0.5
RTOL, ATOL = 1e-4, 1e-5
TWO_STAGE = SCHEDULES[2:]  # the schedules with two stages per process


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _sequential() -> nn.Sequential:
    """8 top-level entries: one per stage at pp=4 under a two-stage schedule."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)),
                         nn.Linear(16, 3))


def _data(kind: str, n: int = GBS * STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "gpt":
        return random_tokens(n, CONFIG, seed=1)
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _per_example(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _token_loss(out, y) if kind == "gpt" else F.cross_entropy(out, y, reduction="none")


def _model(kind: str) -> nn.Module:
    return _gpt() if kind == "gpt" else _sequential()


def _loop(strategy, kind: str, *, n: int = GBS * STEPS, batch: int = GBS, save_after: int = 0,
          checkpoint: str = "") -> dict:
    """The custom loop through strategy.forward_backward; what it leaves on this process."""
    with strategy.scope():
        model = _model(kind)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    bubble_before = strategy.pipeline_bubble_fraction
    x, y = _data(kind, n)
    norms, losses, outputs = [], [], []
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=batch, shuffle=False):
        loss, out = strategy.forward_backward(
            model, xb, yb, lambda out, yb: towers.compute_average_loss(_per_example(kind, out, yb)))
        norms.append(float(strategy.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(strategy.reduce("sum", loss)))
        outputs.append(None if out is None else tuple(out.shape))
        if len(norms) == save_after:
            towers.checkpoint.save_checkpoint(checkpoint, {"model": model, "optimizer": optimizer, "step": save_after},
                                              strategy=strategy)
    with torch.no_grad():
        evaluated = model(x[:4])
    return {"state": strategy.full_state_dict(model), "norms": norms, "losses": losses, "outputs": outputs,
            "evaluated": evaluated, "names": [n for n, _ in strategy.unwrap(model).named_parameters()],
            "bubble": strategy.pipeline_bubble_fraction, "bubble_before": bubble_before}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _pp2_job(checkpoint: str) -> dict:
    lines = _Lines()
    logger = logging.getLogger("towers.parallel.pipeline")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out: dict = {}
    for name in SCHEDULES:
        for kind in ("gpt", "sequential"):
            strategy = towers.FullyShardedStrategy(mesh="pp=2", pp_schedule=name, pp_microbatches=4)
            out[f"{name} {kind}"] = _loop(strategy, kind, **(
                {"save_after": 2, "checkpoint": checkpoint} if (name, kind) == ("zbv_zero_bubble", "gpt") else {}))
    out["first step"] = [line for line in lines.lines if "bubble" in line]
    lines.lines.clear()
    # Shapes a schedule cannot run: a last batch of 2 examples (2 micro-batches) under DualPipeV; 5 micro-batches under
    # interleaved 1F1B (not a multiple of its rounds).
    out["dualpipe_v ragged"] = _loop(towers.FullyShardedStrategy(mesh="pp=2", pp_schedule="dualpipe_v"), "gpt",
                                     n=2 * GBS + 2)
    out["interleaved_1f1b 5"] = _loop(towers.FullyShardedStrategy(
        mesh="pp=2", pp_schedule="interleaved_1f1b", pp_microbatches=5), "sequential", n=20, batch=10)
    out["fallbacks"] = [line for line in lines.lines if "this shape runs" in line]
    strategy = towers.FullyShardedStrategy(mesh="pp=2", pp_schedule="dualpipe_v")
    with strategy.scope():
        net = _gpt()
        trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                                 loss=lambda logits, y, reduction="none": _token_loss(logits, y), clip_grad_norm=CLIP,
                                 strategy=strategy, breakdown_every=0)
    history = trainer.fit(_data("gpt"), epochs=1, global_batch_size=GBS, shuffle=False)
    out["trainer"] = {"state": strategy.full_state_dict(trainer.model), "loss": history["loss"]}
    return out


def _four_job() -> dict:
    out = {}
    for name in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v"):
        strategy = towers.FullyShardedStrategy(mesh="pp=2,dp=2", pp_schedule=name, pp_microbatches=4)
        out[f"pp=2,dp=2 {name}"] = _loop(strategy, "gpt")
    out["pp=2,tp=2 interleaved_1f1b"] = _loop(towers.FullyShardedStrategy(
        mesh="pp=2,tp=2", pp_schedule="interleaved_1f1b", pp_microbatches=4), "gpt")
    for name in TWO_STAGE:
        strategy = towers.FullyShardedStrategy(mesh="pp=4", pp_schedule=name, pp_microbatches=8)
        out[f"pp=4 {name}"] = _loop(strategy, "sequential")
    return out


def _plain(kind: str, *, n: int = GBS * STEPS, batch: int = GBS, keep_after: int = 0) -> dict:
    """The loop on one device without towers."""
    model = _model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data(kind, n)
    norms, losses, kept = [], [], {}
    for start in range(0, n, batch):
        xb, yb = x[start:start + batch], y[start:start + batch]
        loss = _per_example(kind, model(xb), yb).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(norms) == keep_after:
            kept = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "momenta": {k: optimizer.state[p]["momentum_buffer"].clone() for k, p in model.named_parameters()}}
    with torch.no_grad():
        evaluated = model(x[:4])
    return {"state": model.state_dict(), "norms": norms, "losses": losses, "evaluated": evaluated, "kept": kept}


def _close(got: dict, want: dict) -> float:
    """Assert ``got`` equals ``want`` name by name, in the model's order; return the largest absolute difference."""
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _same_as_plain(run: dict, plain: dict) -> float:
    difference = _close(run["state"], plain["state"])
    assert run["norms"] == pytest.approx(plain["norms"], rel=1e-5)
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    torch.testing.assert_close(run["evaluated"], plain["evaluated"], rtol=RTOL, atol=ATOL)
    return difference


@pytest.fixture(scope="module")
def plain() -> dict:
    return {"gpt": _plain("gpt", keep_after=2), "sequential": _plain("sequential")}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> tuple[list[dict], str]:
    checkpoint = str(tmp_path_factory.mktemp("schedules") / "zbv")
    return towers.spawn(_pp2_job, 2, args=(checkpoint,), timeout_s=200), checkpoint


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("kind", ["gpt", "sequential"])
def test_each_schedule_at_pp2_trains_as_one_device(pp2, plain, name, kind):
    results, _ = pp2
    for r in results:
        _same_as_plain(r[f"{name} {kind}"], plain[kind])
    last = 0 if name in ("zbv_zero_bubble", "dualpipe_v") else 1  # a V's last stage is on process 0
    assert [r[f"{name} {kind}"]["outputs"][0] is not None for r in results] == [p == last for p in range(2)]


def test_two_stage_schedules_hold_stages_r_and_r_plus_pp_or_a_v(pp2):
    results, _ = pp2
    blocks = {name: [sorted({n.split(".")[1] for n in r[f"{name} gpt"]["names"] if n.startswith("blocks.")})
                     for r in results] for name in SCHEDULES}
    assert blocks["1f1b"] == blocks["gpipe"] == [["0", "1"], ["2", "3"]]
    for name in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble"):
        assert blocks[name] == [["0", "2"], ["1", "3"]]
    for name in ("zbv_zero_bubble", "dualpipe_v"):
        assert blocks[name] == [["0", "3"], ["1", "2"]]  # a V: process 0 holds the first and the last stage
        assert "head.weight" in results[0][f"{name} gpt"]["names"]


def test_the_bubble_is_logged_at_the_first_step_and_on_the_strategy(pp2):
    results, _ = pp2
    for r in results:
        assert r["1f1b gpt"]["bubble"] == pytest.approx(1 / 5)  # (pp - 1) / (micro-batches + pp - 1)
        assert r["interleaved_1f1b gpt"]["bubble"] == pytest.approx(1 / 9)  # two stages per process: 1 / (2 * 4 + 1)
        for name in SCHEDULES:
            assert r[f"{name} gpt"]["bubble"] == r[f"{name} gpt"]["bubble_before"]
        assert r["zbv_zero_bubble gpt"]["bubble"] < r["interleaved_1f1b gpt"]["bubble"] < r["1f1b gpt"]["bubble"]
    logged = results[0]["first step"]
    assert len(logged) == 2 * len(SCHEDULES)  # one line per prepared model, at its first step
    assert logged[0] == ("pipeline: Schedule1F1B over 4 micro-batch(es) on pp=2 (1 stage(s) per process): bubble 0.200 "
                         "of the step (idle slots over all slots; a forward 1, a backward 2)")
    assert "ScheduleZBVZeroBubble over 4 micro-batch(es) on pp=2 (2 stage(s) per process): bubble 0.040" in logged[10]


def test_a_shape_a_schedule_cannot_run_falls_back_with_a_log_line_and_trains_as_one_device(pp2):
    results, _ = pp2
    ragged = _plain("gpt", n=2 * GBS + 2)
    fives = _plain("sequential", n=20, batch=10)
    for r in results:
        _same_as_plain(r["dualpipe_v ragged"], ragged)
        _same_as_plain(r["interleaved_1f1b 5"], fives)
        assert r["dualpipe_v ragged"]["bubble"] == pytest.approx(1 / 7)  # ZBV's, for the last batch's 2 micro-batches
    assert results[0]["fallbacks"] == [
        "pipeline: a share of 2 example(s) runs 2 micro-batch(es); DualPipeV needs at least as many micro-batches as "
        "stages (4): this shape runs ScheduleZBVZeroBubble",
        "pipeline: a share of 10 example(s) runs 5 micro-batch(es); ScheduleInterleaved1F1B needs a micro-batch count "
        "that divides into rounds of pp=2: this shape runs ScheduleLoopedBFS"]


def test_a_checkpoint_written_with_two_stages_per_process_restores_into_one_plain_process(pp2, plain):
    _, checkpoint = pp2
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    saved = towers.checkpoint.restore_checkpoint(checkpoint, {"model": model, "optimizer": optimizer})
    assert saved["step"] == 2
    _close(model.state_dict(), plain["gpt"]["kept"]["model"])
    _close({n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}, plain["gpt"]["kept"]["momenta"])


def test_trainer_fit_under_dualpipe_v_has_one_history_and_one_devices_parameters(pp2, plain):
    results, _ = pp2
    for r in results:
        _close(r["trainer"]["state"], plain["gpt"]["state"])
    assert results[0]["trainer"]["loss"] == results[1]["trainer"]["loss"]
    assert results[0]["trainer"]["loss"][0] == pytest.approx(sum(plain["gpt"]["losses"]) / STEPS, rel=1e-5)


def test_two_stage_schedules_at_pp2_dp2_pp2_tp2_and_pp4_train_as_one_device(plain):
    results = towers.spawn(_four_job, 4, timeout_s=200)
    for r in results:
        for name in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v"):
            _same_as_plain(r[f"pp=2,dp=2 {name}"], plain["gpt"])
        _same_as_plain(r["pp=2,tp=2 interleaved_1f1b"], plain["gpt"])
        for name in TWO_STAGE:
            _same_as_plain(r[f"pp=4 {name}"], plain["sequential"])
    # pp=4: process r holds entries r and r + 4, or r and 7 - r under a V
    assert results[1]["pp=4 interleaved_1f1b"]["names"][0].startswith("1.") and "5.0.weight" in results[1][
        "pp=4 interleaved_1f1b"]["names"]
    assert "6.0.weight" in results[1]["pp=4 dualpipe_v"]["names"] and "7.weight" in results[0]["pp=4 dualpipe_v"]["names"]
