"""A token mask under pipeline parallelism keeps one device's maths: the masked token mean of the global batch.

One spawn of 4 processes. Under ``FullyShardedStrategy(mesh="pp=2,dp=2")`` and ``mesh="pp=2,tp=2"``
(``towers launch --strategy sharded --mesh ...``) the custom loop trains towers' GPT through
``strategy.forward_backward`` on ``compute_average_loss(per_token, weights=(y != -100).float())``,
clipped with ``strategy.clip_grad_norm_``, on two kinds of masked batches: right padding (each
sequence's labels end at its length) and prompt masking (labels -100 on a prefix; two sequences
entirely masked, so a whole micro-batch weighs nothing). The reference is the loop a user writes on one
device without towers: ``F.cross_entropy(..., ignore_index=-100)`` (the mean over the global batch's
unmasked tokens), torch's ``clip_grad_norm_``, SGD with momentum. The same spawn also trains with
gradient accumulation (2 batches of 4 per update at pp=2,dp=2), with loss parallelism (pp=2,tp=2), and
``Trainer.fit`` with a loss that returns its batch's mean token loss (pp=2,dp=2); and checks that a
micro-batch whose loss is normalised by examples in an update of weighted ones is refused on every
stage (not only on the last one, where the loss is computed, while the others would wait).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens

pytestmark = pytest.mark.timeout(240)

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
GBS, STEPS, CLIP, LR, IGNORE = 8, 2, 0.5, 0.5, -100
RTOL, ATOL = 1e-4, 1e-5
KINDS = ("right_padding", "prompt_masking")
# Per sequence: the tokens it keeps (right padding) and the prefix its labels mask (prompt masking). Micro-batches
# and replicas get very different counts; sequences 12 and 13 are masked whole.
LENGTHS = [8, 8, 2, 1, 5, 3, 8, 4, 3, 7, 8, 8, 1, 2, 6, 5]
PROMPTS = [7, 0, 3, 5, 2, 6, 1, 4, 0, 0, 6, 7, 8, 8, 2, 3]


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = random_tokens(GBS * STEPS, CONFIG, seed=1)
    positions = torch.arange(CONFIG.block_size)
    if kind == "right_padding":
        padding = positions >= torch.tensor(LENGTHS)[:, None]
        return x.masked_fill(padding, 0), y.masked_fill(padding, IGNORE)
    return x, y.masked_fill(positions < torch.tensor(PROMPTS)[:, None], IGNORE)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _masked_loss(out: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    per_token = F.cross_entropy(out.flatten(0, 1), yb.flatten(), reduction="none").view(len(yb), -1)
    return towers.compute_average_loss(per_token, weights=(yb != IGNORE).float())


def _mean_token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def _loop(strategy: towers.Strategy, kind: str, batch: int = GBS) -> dict:
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    norms, losses = [], []
    for xb, yb in strategy.distribute_dataset(_data(kind), global_batch_size=batch, shuffle=False):
        loss, _ = strategy.forward_backward(model, xb, yb, _masked_loss)
        norms.append(float(strategy.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(strategy.reduce("sum", loss)))
    return {"state": strategy.full_state_dict(model), "norms": norms, "losses": losses}


def _mixed_update_refused(strategy: towers.Strategy) -> str:
    """A weighted micro-batch, then one normalised by examples, in one update: the error every stage raises."""
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = strategy.prepare(model, optimizer)
    calls = []

    def mixed(out, yb):
        calls.append(1)
        if len(calls) == 1:
            return _masked_loss(out, yb)
        return towers.compute_average_loss(F.cross_entropy(out.flatten(0, 1), yb.flatten(), reduction="none"))

    xb, yb = next(iter(strategy.distribute_dataset(_data("prompt_masking"), global_batch_size=GBS, shuffle=False)))
    try:
        strategy.forward_backward(model, xb, yb, mixed)
    except ValueError as exc:
        return f"{type(exc).__name__} after {len(calls)} call(s): {exc}"
    return "not refused"


def _job() -> dict:
    out = {}
    for mesh in ("pp=2,dp=2", "pp=2,tp=2"):
        strategy = towers.FullyShardedStrategy(mesh=mesh)
        for kind in KINDS:
            out[f"{mesh} {kind}"] = _loop(strategy, kind)
        if mesh == "pp=2,dp=2":
            out["refused"] = _mixed_update_refused(strategy)
    accumulating = towers.FullyShardedStrategy(mesh="pp=2,dp=2", gradient_accumulation_steps=2)
    out["accumulated"] = _loop(accumulating, "right_padding", batch=GBS // 2)
    out["loss_parallel"] = _loop(towers.FullyShardedStrategy(mesh="pp=2,tp=2", loss_parallel=True), "prompt_masking")
    strategy = towers.FullyShardedStrategy(mesh="pp=2,dp=2")
    with strategy.scope():
        net = _model()
        trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), loss=_mean_token_loss,
                                 clip_grad_norm=CLIP, strategy=strategy, breakdown_every=0)
    history = trainer.fit(_data("prompt_masking"), epochs=1, global_batch_size=GBS, shuffle=False)
    out["trainer"] = {"state": strategy.full_state_dict(trainer.model), "loss": history["loss"][0]}
    return out


def _plain(kind: str) -> dict:
    """The loop on one device without towers: the mean over the global batch's unmasked tokens."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data(kind)
    norms, losses, tokens = [], [], []
    for i in range(STEPS):
        xb, yb = x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS]
        logits = model(xb)
        loss = _mean_token_loss(logits, yb)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        tokens.append(F.cross_entropy(logits.detach().flatten(0, 1), yb.flatten(), reduction="none",
                                      ignore_index=IGNORE).view(GBS, -1))
    return {"state": model.state_dict(), "norms": norms, "losses": losses, "tokens": tokens, "labels": y}


def _logged(plain: dict, replicas: int, batches: int) -> list[float]:
    """What the loop logs without a pipeline: each batch's replicas' masked means, summed, over replicas x batches."""
    logged = []
    for step, tokens in enumerate(plain["tokens"]):
        weights = (plain["labels"][step * GBS:(step + 1) * GBS] != IGNORE).float()
        for share_tokens, share_weights in zip(tokens.chunk(batches), weights.chunk(batches)):
            means = [(t * w).sum() / w.sum() if w.sum() > 0 else torch.zeros(())
                     for t, w in zip(share_tokens.chunk(replicas), share_weights.chunk(replicas))]
            logged.append(float(sum(means)) / (replicas * batches))
    return logged


def _close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def plain() -> dict[str, dict]:
    return {kind: _plain(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return towers.spawn(_job, 4, timeout_s=200)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mesh", ["pp=2,dp=2", "pp=2,tp=2"])
def test_a_masked_token_mean_under_a_pipeline_trains_as_one_device(results, plain, mesh, kind):
    want = plain[kind]
    replicas = 2 if "dp=2" in mesh else 1
    for r in results:
        got = r[f"{mesh} {kind}"]
        _close(got["state"], want["state"])
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)  # the whole model's, over both stages
        assert got["losses"] == pytest.approx(_logged(want, replicas, 1), rel=1e-5, abs=1e-6)  # as without pp
    if replicas == 1:  # one replica: the loss logged is the plain loop's mean
        assert results[0][f"{mesh} {kind}"]["losses"] == pytest.approx(want["losses"], rel=1e-5)


def test_a_masked_token_mean_accumulated_over_two_batches_under_pp_trains_as_one_device(results, plain):
    want = plain["right_padding"]
    for r in results:
        got = r["accumulated"]
        _close(got["state"], want["state"])
        assert got["norms"][1::2] == pytest.approx(want["norms"], rel=1e-5)  # clipped once, on the update's gradient
        assert got["losses"] == pytest.approx(_logged(want, 2, 2), rel=1e-5, abs=1e-6)


def test_a_masked_token_mean_under_pp_with_loss_parallelism_trains_as_one_device(results, plain):
    want = plain["prompt_masking"]
    for r in results:
        _close(r["loss_parallel"]["state"], want["state"])
        assert r["loss_parallel"]["norms"] == pytest.approx(want["norms"], rel=1e-5)
        assert r["loss_parallel"]["losses"] == pytest.approx(want["losses"], rel=1e-5)


def test_trainer_fit_on_a_mean_token_loss_under_pp_trains_as_one_device(results, plain):
    want = plain["prompt_masking"]
    labels = want["labels"] != IGNORE
    epoch_mean = float(torch.cat(want["tokens"])[labels].mean())  # the label-weighted mean over the epoch
    for r in results:
        _close(r["trainer"]["state"], want["state"])
        assert r["trainer"]["loss"] == pytest.approx(epoch_mean, rel=1e-5)


def test_an_update_mixing_weighted_and_example_normalised_losses_is_refused_on_every_stage(results):
    said = [r["refused"] for r in results]
    for text in said:
        assert "after 2 call(s)" in text or "after 0 call(s)" in text, said  # the loss runs on the last stage only
        assert "cannot share an update" in text and "Normalise every term of the update the same way" in text
    assert "last stage" in said[0] and "last stage" not in said[2]  # stage 0 says where it was raised
