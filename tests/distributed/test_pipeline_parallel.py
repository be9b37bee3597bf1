"""Pipeline parallelism on a (pp, dp) mesh keeps one device's maths: the same GPT at 4 processes and at 1.

One spawn of 4 processes. Under ``FullyShardedStrategy(mesh="pp=2,dp=2")`` each model replica is a
pipeline of 2 processes (stage 0: the embeddings and blocks 0-1; stage 1: blocks 2-3, ``ln_f`` and
``head``) fed the same batch, and FSDP2 shards each stage over the 2 replicas. The reference is the
plain torch loop a user writes on one device (no towers): per-example token losses, their mean over
the global batch, torch's ``clip_grad_norm_``, SGD with momentum. These runs match it within rtol
1e-4: the custom loop through ``strategy.forward_backward`` (1F1B, 2 micro-batches per share),
``Trainer.fit`` (GPipe, 4 micro-batches per share), ``mesh="pp=4"`` (one block per stage, 1F1B, 4
micro-batches), ``mesh="pp=2,tp=2"`` (each stage's layers split over tp; plain, with sequence
parallelism, and with loss parallelism), gradient accumulation (2 batches of 4 per update, clipped
once), and ``mesh="pp=2,dp=2,tp=2"`` on 8 processes (a second spawn); ``Trainer.fit`` in bf16 with
accumulation within 1e-2. Under ``torch.no_grad()`` each pipelined model returns the trained plain
model's logits on every stage; calling it directly with gradients on is refused with the API to use.

Checkpoints: the custom loops save after 2 updates (each stage its part, sharded over dp). The
pp=2,dp=2 one restores into one plain process (this test's: the plain loop's parameters and SGD momenta
after 2 updates) and into a fresh pp=2,dp=2 job, whose third update equals the plain loop's; a
checkpoint the plain loop wrote in one process restores into pp=2,dp=2 the same way. The Trainer's
checkpoint under GPipe loads into a new Trainer (which resumes for a second epoch as the plain loop
trains it) and into one plain process.
"""

from __future__ import annotations

import pytest
import torch

import towers
from gpt_support import token_loss as _token_loss
from towers.models_gpt import GPT, GPTConfig, random_tokens

pytestmark = pytest.mark.timeout(240)

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16)
GBS, STEPS, CLIP, LR = 8, 3, 0.5, 0.5
SAVED_AFTER = 2  # updates before the custom loops save a checkpoint
RTOL, ATOL = 1e-4, 1e-5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GBS * STEPS, CONFIG, seed=1)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _step(strategy, model, optimizer, xb, yb) -> tuple[torch.Tensor, object, float]:
    loss, out = strategy.forward_backward(model, xb, yb,
                                          lambda out, yb: towers.compute_average_loss(_token_loss(out, yb)))
    norm = float(strategy.clip_grad_norm_(model.parameters(), CLIP))
    optimizer.step()
    optimizer.zero_grad()
    return loss, out, norm


def _custom_loop(strategy, checkpoint_dir: str, batch: int = GBS) -> dict:
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = _data()
    norms, losses, outputs, kinds = [], [], [], set()
    for xb, yb in strategy.distribute_dataset((x, y), global_batch_size=batch, shuffle=False):
        loss, out, norm = _step(strategy, model, optimizer, xb, yb)
        norms.append(norm)
        losses.append(float(strategy.reduce("sum", loss)))
        outputs.append(None if out is None else tuple(out.shape))
        kinds.add(type(out).__name__)
        if len(norms) == SAVED_AFTER and batch == GBS:  # each stage writes its part
            towers.checkpoint.save_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer,
                                                               "step": SAVED_AFTER}, strategy=strategy)
    try:
        model(x[:2])
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    with torch.no_grad():  # evaluation: the whole pipeline forward, its output on every stage
        evaluated = model(x[:4])
    names = sorted(n for n, _ in strategy.unwrap(model).named_parameters())
    return {"state": strategy.full_state_dict(model), "norms": norms, "losses": losses, "outputs": outputs,
            "refused": refused, "names": names, "evaluated": evaluated, "shape": tuple(strategy.mesh.shape), "kinds": kinds,
            "qkv": _local_rows(strategy.unwrap(model), "blocks.0.attn.qkv.weight")}


def _local_rows(stage, name: str) -> int | None:
    """The rows of ``name`` this process holds (its tp and dp slice), None where its stage does not hold it."""
    param = dict(stage.named_parameters()).get(name)
    return None if param is None else int(param.to_local().shape[0])


def _resume(checkpoints: dict[str, str]) -> dict:
    """A fresh pp=2,dp=2 job restores each checkpoint, then trains the remaining update."""
    strategy = towers.FullyShardedStrategy(mesh="pp=2,dp=2")
    with strategy.scope():
        torch.manual_seed(1)  # other weights than the saved ones: the restore must replace them
        model = GPT(CONFIG)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = _data()
    out = {}
    for name, path in checkpoints.items():
        saved = towers.checkpoint.restore_checkpoint(path, {"model": model, "optimizer": optimizer}, strategy=strategy)
        norms = [_step(strategy, model, optimizer, xb, yb)[2] for xb, yb in strategy.distribute_dataset(
            (x[SAVED_AFTER * GBS:], y[SAVED_AFTER * GBS:]), global_batch_size=GBS, shuffle=False)]
        out[name] = {"step": saved["step"], "norms": norms, "state": strategy.full_state_dict(model)}
    return out


def _trainer(strategy, seed: int = 0):
    with strategy.scope():
        torch.manual_seed(seed)
        net = GPT(CONFIG)
        return towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9), loss=_per_token_loss,
                              clip_grad_norm=CLIP, strategy=strategy, breakdown_every=0)


def _job(checkpoint_dir: str, plain_checkpoint: str) -> dict:
    strategy = towers.FullyShardedStrategy(mesh="pp=2,dp=2")
    loop = _custom_loop(strategy, checkpoint_dir)
    facts = {"replicas": strategy.num_replicas_in_sync, "mesh": tuple(strategy.mesh.mesh_dim_names),
             "shape": tuple(strategy.mesh.shape), "pp": strategy.pipeline_parallel_size, "chief": strategy.is_chief}
    resumed = _resume({"plain": plain_checkpoint, "pp2dp2": checkpoint_dir})

    gpipe = towers.FullyShardedStrategy(mesh="pp=2,dp=2", pp_schedule="gpipe", pp_microbatches=4)
    trainer = _trainer(gpipe)
    history = trainer.fit(_data(), epochs=1, global_batch_size=GBS, shuffle=False)
    trainer.save_checkpoint(checkpoint_dir + "-trainer")
    fit = {"state": gpipe.full_state_dict(trainer.model), "loss": history["loss"]}
    again = _trainer(gpipe, seed=1)
    again.load_checkpoint(checkpoint_dir + "-trainer")  # resumes at epoch 1: a second epoch over the same batches
    again.fit(_data(), epochs=2, global_batch_size=GBS, shuffle=False)
    fit["resumed"] = gpipe.full_state_dict(again.model)

    pp4 = _custom_loop(towers.FullyShardedStrategy(mesh="pp=4"), checkpoint_dir + "-pp4")
    pp2tp2 = _custom_loop(towers.FullyShardedStrategy(mesh="pp=2,tp=2"), checkpoint_dir + "-pp2tp2")
    sp = _custom_loop(towers.FullyShardedStrategy(mesh="pp=2,tp=2", sequence_parallel=True), checkpoint_dir + "-sp")
    lp = _custom_loop(towers.FullyShardedStrategy(mesh="pp=2,tp=2", loss_parallel=True), checkpoint_dir + "-lp")
    # Accumulation: each update's 8 examples as 2 batches of 4 (each cut into micro-batches); fit also in bf16.
    accumulated = _custom_loop(towers.FullyShardedStrategy(mesh="pp=2,dp=2", gradient_accumulation_steps=2),
                               checkpoint_dir + "-acc", batch=GBS // 2)
    bf16 = _trainer(towers.FullyShardedStrategy(mesh="pp=2,dp=2", gradient_accumulation_steps=2, precision="bf16"))
    bf16.fit(_data(), epochs=1, global_batch_size=GBS // 2, shuffle=False)
    fit["bf16"] = bf16.strategy.full_state_dict(bf16.model)
    return {"loop": loop, "facts": facts, "fit": fit, "pp4": pp4, "pp2tp2": pp2tp2, "pp2tp2sp": sp, "pp2tp2lp": lp,
            "accumulated": accumulated, "resumed": resumed}


def _per_token_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    return _token_loss(logits, y)


def _plain_loop(steps: int = STEPS, checkpoint: str | None = None) -> tuple[dict, list[float], list[float], dict]:
    """The loop on one device without towers; returns the final state, norms, losses, and after SAVED_AFTER updates
    the parameters and SGD momenta by name (also written as a one-process checkpoint at ``checkpoint``)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = _data()
    norms, losses, saved = [], [], {}
    for i in range(steps):
        xb, yb = x[i % STEPS * GBS:(i % STEPS + 1) * GBS], y[i % STEPS * GBS:(i % STEPS + 1) * GBS]
        loss = _token_loss(model(xb), yb).mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if i + 1 == SAVED_AFTER:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "momenta": {n: optimizer.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}}
            if checkpoint is not None:
                saved["checkpoint"] = checkpoint
                towers.checkpoint.save_checkpoint(checkpoint, {"model": model, "optimizer": optimizer, "step": SAVED_AFTER})
    return model.state_dict(), norms, losses, saved


def _close(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the original names, in the model's order
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[dict, list[float], list[float], dict]:
    return _plain_loop(checkpoint=str(tmp_path_factory.mktemp("plain") / "ckpt"))


@pytest.fixture(scope="module")
def launch(tmp_path_factory, plain) -> tuple[list[dict], object]:
    checkpoint_dir = tmp_path_factory.mktemp("pp") / "ckpt"
    args = (str(checkpoint_dir), plain[3]["checkpoint"])  # the plain loop's one-process checkpoint, for pp=2,dp=2
    return towers.spawn(_job, 4, args=args, timeout_s=200), checkpoint_dir


def test_pp2_dp2_custom_loop_trains_as_one_device(launch, plain):
    results, _ = launch
    reference, norms, losses, _ = plain
    facts = [r["facts"] for r in results]
    assert [f["chief"] for f in facts] == [True, False, False, False]
    assert {(f["replicas"], f["mesh"], f["shape"], f["pp"]) for f in facts} == {(2, ("pp", "dp_shard"), (2, 2), 2)}
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
    reference, _, losses, _ = plain
    for r in results:
        _close(r["fit"]["state"], reference)
    assert {tuple(r["fit"]["loss"]) for r in results} == {tuple(results[0]["fit"]["loss"])}
    assert results[0]["fit"]["loss"][0] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_gradient_accumulation_under_pp_clips_once_per_update_and_trains_as_one_device(launch, plain):
    results, _ = launch
    reference, norms, _, _ = plain
    for r in results:
        _close(r["accumulated"]["state"], reference)
        assert r["accumulated"]["norms"][1::2] == pytest.approx(norms, rel=1e-5)  # the whole update's norm, clipped once


def test_bf16_under_pp_computes_in_bf16_and_stays_near_one_device(launch, plain):
    results, _ = launch
    reference = plain[0]
    for r in results:
        got = r["fit"]["bf16"]
        assert any(not torch.equal(got[k], reference[k]) for k in reference)  # the stages did compute in bf16
        for key in reference:  # float32 master weights; bf16 matmuls
            torch.testing.assert_close(got[key], reference[key], rtol=2e-2, atol=1e-2, msg=lambda m, k=key: f"{k}: {m}")


def test_pp4_one_block_per_stage_trains_as_one_device(launch, plain):
    results, _ = launch
    reference, norms, _, _ = plain
    assert [r["pp4"]["names"][0].split(".")[1] for r in results] == ["0", "1", "2", "3"]
    for r in results:
        _close(r["pp4"]["state"], reference)
        assert r["pp4"]["norms"] == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("run", ["pp2tp2", "pp2tp2sp", "pp2tp2lp"])
def test_pp2_tp2_each_stage_split_over_tp_trains_as_one_device(launch, plain, run):
    results, _ = launch
    reference, norms, losses, _ = plain
    stage0, stage1 = results[0][run]["names"], results[2][run]["names"]  # ranks 0, 1: stage 0 over tp
    assert "wte.weight" in stage0 and "head.weight" in stage1 and not any(n.startswith("blocks.2.") for n in stage0)
    assert {r[run]["shape"] for r in results} == {(2, 1, 2)}
    assert [r[run]["qkv"] for r in results] == [3 * CONFIG.n_embd // 2] * 2 + [None] * 2  # half the heads each
    # the last stage's outputs: whole logits, or under loss parallelism the head's slices of the vocabulary
    assert [r[run]["kinds"] for r in results] == [{"NoneType"}] * 2 + [{"DTensor" if run == "pp2tp2lp" else "Tensor"}] * 2
    for r in results:
        _close(r[run]["state"], reference)
        assert r[run]["norms"] == pytest.approx(norms, rel=1e-5)
        assert r[run]["losses"] == pytest.approx(losses, rel=1e-5)


def test_a_pipelined_model_under_no_grad_returns_the_whole_models_output_on_every_stage(launch, plain):
    results, _ = launch
    model = GPT(CONFIG)
    model.load_state_dict(plain[0])
    with torch.no_grad():
        want = model(_data()[0][:4])  # the trained plain model's logits
    for r in results:
        for run in ("loop", "pp4", "pp2tp2", "pp2tp2sp", "pp2tp2lp"):
            torch.testing.assert_close(r[run]["evaluated"], want, rtol=RTOL, atol=ATOL)


def test_a_pipelined_model_called_directly_is_refused_with_the_api_to_use(launch):
    results, _ = launch
    for r in results:
        assert "strategy.forward_backward(model, x, y, loss_fn)" in r["loop"]["refused"]


def _restored_in_one_process(path) -> tuple[dict, dict, dict]:
    model = GPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    saved = towers.checkpoint.restore_checkpoint(path, {"model": model, "optimizer": optimizer})
    momenta = {n: optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters()}
    return model.state_dict(), momenta, saved


def test_a_checkpoint_written_under_pp_restores_into_one_plain_process(launch, plain):
    _, checkpoint_dir = launch
    _, _, _, after_two = plain
    for path in (checkpoint_dir, f"{checkpoint_dir}-pp4"):  # pp=2,dp=2 (stages sharded over dp) and pp=4
        state, momenta, saved = _restored_in_one_process(path)
        assert saved["step"] == SAVED_AFTER
        _close(state, after_two["model"])
        _close(momenta, after_two["momenta"])  # SGD's momentum of every stage's parameters, by name


def test_a_checkpoint_restores_into_pp2_dp2_and_the_next_update_is_one_devices(launch, plain):
    results, _ = launch
    reference, norms, _, _ = plain
    for r in results:
        for written_by in ("pp2dp2", "plain"):  # resumed from pp=2,dp=2, and from one process
            resumed = r["resumed"][written_by]
            assert resumed["step"] == SAVED_AFTER
            _close(resumed["state"], reference)  # = the uninterrupted run's third update
            assert resumed["norms"] == pytest.approx(norms[SAVED_AFTER:], rel=1e-5)


def test_the_trainers_checkpoint_under_pp_resumes_and_loads_into_one_process(launch, plain):
    results, checkpoint_dir = launch
    two_epochs, _, _, _ = _plain_loop(steps=2 * STEPS)
    for r in results:
        _close(r["fit"]["resumed"], two_epochs)  # loaded after epoch 1, trained epoch 2 as one device does
    one_epoch, momenta, _ = _restored_in_one_process(f"{checkpoint_dir}-trainer")
    _close(one_epoch, plain[0])
    assert set(momenta) == {n for n, _ in GPT(CONFIG).named_parameters()}
    assert len(towers.checkpoint.load_checkpoint(f"{checkpoint_dir}-trainer")["rng"]) == 2  # one per replica


def _three_d_job(checkpoint_dir: str) -> dict:
    return _custom_loop(towers.FullyShardedStrategy(mesh="pp=2,dp=2,tp=2"), checkpoint_dir)


def test_pp2_dp2_tp2_on_8_processes_trains_as_one_device(plain, tmp_path):
    """3-D: 2 stages, each split over tp=2 and sharded over dp=2 (FSDP2 over TP's split)."""
    results = towers.spawn(_three_d_job, 8, args=(str(tmp_path / "ckpt"),), timeout_s=240, threads_per_process=1)
    reference, norms, losses, _ = plain
    assert {r["shape"] for r in results} == {(2, 2, 2)}
    assert [r["qkv"] for r in results] == [3 * CONFIG.n_embd // 2 // 2] * 4 + [None] * 4  # rows over dp, heads over tp
    for r in results:
        _close(r["state"], reference)
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
