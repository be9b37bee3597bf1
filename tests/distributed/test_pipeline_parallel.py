"""Pipeline parallelism on a (pp, dp) mesh keeps one device's maths: the same GPT at 4 processes and at 1.

One spawn of 4 processes. Under ``FullyShardedStrategy(mesh="pp=2,dp=2")`` each model replica is a
pipeline of 2 processes (stage 0: the embeddings and blocks 0-1; stage 1: blocks 2-3, ``ln_f`` and
``head``) fed the same batch, and FSDP2 shards each stage over the 2 replicas. The reference is the
plain torch loop a user writes on one device (no towers): per-example token losses, their mean over
the global batch, torch's ``clip_grad_norm_``, SGD with momentum. Three runs must match it within
rtol 1e-4: the custom loop through ``strategy.forward_backward`` (1F1B, 2 micro-batches per share),
``Trainer.fit`` (GPipe, 4 micro-batches per share), and ``mesh="pp=4"`` (one block per stage, 1F1B,
4 micro-batches). Calling the pipelined model directly, or
checkpointing it, is refused with the API to use.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import towers
from towers.models_gpt import GPT, GPTConfig, random_tokens

pytestmark = pytest.mark.timeout(240)

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16)
GBS, STEPS, CLIP, LR = 8, 3, 0.5, 0.5
RTOL, ATOL = 1e-4, 1e-5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GBS * STEPS, CONFIG, seed=1)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean token loss (one value per example)."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(len(y), -1).mean(1)


def _custom_loop(strategy, checkpoint_dir: str) -> dict:
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = _data()
    norms, losses, outputs = [], [], []
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=GBS, shuffle=False):
        loss, out = strategy.forward_backward(model, xb, yb,
                                              lambda out, yb: towers.compute_average_loss(_token_loss(out, yb)))
        norms.append(float(strategy.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(strategy.reduce("sum", loss)))
        outputs.append(None if out is None else tuple(out.shape))
    try:
        model(x[:2])
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    try:
        towers.checkpoint.save_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer}, strategy=strategy)
        unsaved = ""
    except NotImplementedError as exc:
        unsaved = str(exc)
    names = sorted(n for n, _ in strategy.unwrap(model).named_parameters())
    return {"state": strategy.full_state_dict(model), "norms": norms, "losses": losses, "outputs": outputs,
            "refused": refused, "unsaved": unsaved, "names": names}


def _job(checkpoint_dir: str) -> dict:
    strategy = towers.FullyShardedStrategy(mesh="pp=2,dp=2")
    loop = _custom_loop(strategy, checkpoint_dir)
    facts = {"replicas": strategy.num_replicas_in_sync, "mesh": tuple(strategy.mesh.mesh_dim_names),
             "shape": tuple(strategy.mesh.shape), "pp": strategy.pipeline_parallel_size, "chief": strategy.is_chief}

    gpipe = towers.FullyShardedStrategy(mesh="pp=2,dp=2", pp_schedule="gpipe", pp_microbatches=4)
    with gpipe.scope():
        net = _model()
        trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), loss=_per_token_loss,
                                 clip_grad_norm=CLIP, strategy=gpipe, breakdown_every=0)
    history = trainer.fit(_data(), epochs=1, global_batch_size=GBS, shuffle=False)
    fit = {"state": gpipe.full_state_dict(trainer.model), "loss": history["loss"]}

    pp4 = _custom_loop(towers.FullyShardedStrategy(mesh="pp=4"), checkpoint_dir + "-pp4")
    return {"loop": loop, "facts": facts, "fit": fit, "pp4": pp4}


def _per_token_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    return _token_loss(logits, y)


def _plain_loop() -> tuple[dict, list[float], list[float]]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data()
    norms, losses = [], []
    for i in range(STEPS):
        xb, yb = x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS]
        loss = _token_loss(model(xb), yb).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), norms, losses


def _close(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the original names, in the model's order
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[list[dict], object]:
    checkpoint_dir = tmp_path_factory.mktemp("pp") / "ckpt"
    return towers.spawn(_job, 4, args=(str(checkpoint_dir),), timeout_s=200), checkpoint_dir


@pytest.fixture(scope="module")
def plain() -> tuple[dict, list[float], list[float]]:
    return _plain_loop()


def test_pp2_dp2_custom_loop_trains_as_one_device(launch, plain):
    results, _ = launch
    reference, norms, losses = plain
    facts = [r["facts"] for r in results]
    assert [f["chief"] for f in facts] == [True, False, False, False]
    assert {(f["replicas"], f["mesh"], f["shape"], f["pp"]) for f in facts} == {(2, ("pp", "dp", "tp"), (2, 2, 1), 2)}
    # ranks 0, 1: stage 0 (replicas 0, 1); ranks 2, 3: stage 1; each stage keeps the original names
    stage0, stage1 = results[0]["loop"]["names"], results[2]["loop"]["names"]
    assert stage0[0].startswith("blocks.0.") and "wte.weight" in stage0 and "wpe.weight" in stage0
    assert not any(n.startswith(("blocks.2.", "blocks.3.", "ln_f", "head")) for n in stage0)
    assert "head.weight" in stage1 and "ln_f.weight" in stage1 and not any(n.startswith("blocks.1.") for n in stage1)
    for r in results:
        _close(r["loop"]["state"], reference)  # every process: the whole model, gathered from both stages
        assert r["loop"]["norms"] == pytest.approx(norms, rel=1e-5)  # the whole model's norm, over both stages
        assert r["loop"]["losses"] == pytest.approx(losses, rel=1e-5)  # the last stage's loss, on every stage
    logits = (GBS // 2, CONFIG.block_size, CONFIG.vocab_size)  # a replica's share, merged from its micro-batches
    assert [r["loop"]["outputs"][0] for r in results] == [None, None, logits, logits]  # outputs: the last stage only


def test_trainer_fit_under_gpipe_trains_as_one_device_with_the_same_history_everywhere(launch, plain):
    results, _ = launch
    reference, _, losses = plain
    for r in results:
        _close(r["fit"]["state"], reference)
    assert {tuple(r["fit"]["loss"]) for r in results} == {tuple(results[0]["fit"]["loss"])}
    assert results[0]["fit"]["loss"][0] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_pp4_one_block_per_stage_trains_as_one_device(launch, plain):
    results, _ = launch
    reference, norms, _ = plain
    assert [r["pp4"]["names"][0].split(".")[1] for r in results] == ["0", "1", "2", "3"]
    for r in results:
        _close(r["pp4"]["state"], reference)
        assert r["pp4"]["norms"] == pytest.approx(norms, rel=1e-5)


def test_a_pipelined_model_called_directly_or_checkpointed_is_refused_with_the_api_to_use(launch):
    results, _ = launch
    for r in results:
        assert "strategy.forward_backward(model, x, y, loss_fn)" in r["loop"]["refused"]
        assert "not built yet" in r["loop"]["unsaved"] and "strategy.full_state_dict(model)" in r["loop"]["unsaved"]
