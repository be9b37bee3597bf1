"""Tensor parallelism on a (dp, tp) mesh keeps one device's maths: the same script at 4 processes and at 1.

One spawn of 4 processes under ``FullyShardedStrategy(mesh="dp=2,tp=2")`` (what ``towers launch
--strategy sharded --mesh dp=2,tp=2`` builds): each model replica is 2 processes that split every
block of towers' GPT (attention heads and MLP units) and see the same batch; FSDP2 shards each split
layer over the 2 replicas. The references are the plain torch loops a user writes on one device
(no towers): the README-style custom loop (``compute_average_loss``, SGD with momentum, torch's own
``clip_grad_norm_`` on the prepared parameters) and ``Trainer.fit`` on the model's own loss. The
sharded checkpoint the job writes loads into a plain one-process model and into another mesh (tp=4).

The same spawn then trains again under ``sequence_parallel=True`` (norms and residual stream on half
of the sequence per tp process), towers' GPT and a Hugging Face Llama, against the same plain loops; and
under ``loss_parallel=True`` (the head's logits split over the vocabulary for the loss): the custom loop
through ``strategy.forward_backward`` on a masked token mean (``compute_average_loss(..., weights=)``) and
``Trainer.fit`` with a per-token loss and accuracy, with the loss code unchanged. Last, a Hugging Face
GPT-2 (its Conv1D layers, q/k/v fused, the head tied to the embedding) trains under the same mesh as its
plain loop does. A second spawn, of 8 processes, trains
the custom loop under HSDP with tensor parallelism (``mesh="dp=4,tp=2", shard_group_size=2``).
"""

from __future__ import annotations

import importlib
import importlib.util
import traceback

import pytest
import torch

import towers
from gpt_support import token_loss as _token_loss
from towers.models_gpt import GPT, GPTConfig, random_tokens

pytestmark = pytest.mark.timeout(300)

CONFIG = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=4, n_embd=32)
GBS, STEPS, CLIP = 8, 3, 0.5
RTOL, ATOL = 1e-4, 1e-5  # rounding: TP sums each row-split layer's partial outputs in another order


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    return random_tokens(GBS * STEPS, CONFIG, seed=1)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _custom_loop(strategy: towers.Strategy, model, optimizer, also=None) -> list[float]:
    """The custom loop (``compute_average_loss``, torch's clip, SGD) over the data; ``also(xb, yb)`` after each update
    in the same step. Returns the clip norms."""
    norms = []
    for xb, yb in strategy.distribute_dataset(_data(), global_batch_size=GBS, shuffle=False):
        def step(xb, yb):
            strategy.backward(towers.compute_average_loss(_token_loss(model(xb), yb)))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).full_tensor()))
            optimizer.step()
            optimizer.zero_grad()
            if also is not None:
                also(xb, yb)
        strategy.run(step, args=(xb, yb))
    return norms


def _job(checkpoint_dir: str) -> dict:
    strategy = towers.FullyShardedStrategy(mesh="dp=2,tp=2")
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    x, y = _data()
    norms = _custom_loop(strategy, model, optimizer)
    loop = strategy.full_state_dict(model)
    towers.checkpoint.save_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer}, strategy=strategy)

    with strategy.scope():
        net = _model()
        trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), ignore_index=-1, strategy=strategy,
                                 breakdown_every=0)
    history = trainer.fit((x, y), epochs=1, global_batch_size=GBS, shuffle=False)
    fit = strategy.full_state_dict(trainer.model)
    split = strategy.unwrap(model).blocks[0].attn.qkv.weight
    whole = strategy.unwrap(model).wte.weight
    facts = {"replicas": strategy.num_replicas_in_sync, "mesh": tuple(strategy.mesh.mesh_dim_names),
             "shape": tuple(strategy.mesh.shape),
             "placements": [[type(p).__name__ for p in w.placements] for w in (split, whole)],
             "tp": strategy.tensor_parallel_size, "chief": strategy.is_chief, "loss": history["loss"]}
    phases = {}
    for name, phase in (("sequence_parallel", _sequence_parallel_phase), ("loss_parallel", _loss_parallel_phase),
                        ("gpt2", _gpt2_phase)):
        try:  # a failure here fails that phase's test alone, with this rank's traceback
            phases[name] = phase()
        except Exception:
            phases[name] = {"error": traceback.format_exc()}
    return {"loop": loop, "fit": fit, "norms": norms, "facts": facts, **phases}


def _restore_under(mesh: str, checkpoint_dir: str) -> dict:
    strategy = towers.FullyShardedStrategy(mesh=mesh)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    towers.checkpoint.restore_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer}, strategy=strategy)
    return strategy.full_state_dict(model)


def _plain_loop(loss=lambda logits, yb: _token_loss(logits, yb).mean()) -> tuple[dict, list[float]]:
    """The custom loop on one device without towers (``loss``: the batch's mean token loss by default)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    norms = []
    for i in range(STEPS):
        xb, yb = x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS]
        loss(model(xb), yb).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), norms


def _plain_fit() -> tuple[dict, float]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _data()
    losses = []
    for i in range(STEPS):
        _, loss = model(x[i * GBS:(i + 1) * GBS], y[i * GBS:(i + 1) * GBS])  # nanoGPT's own mean token loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), sum(losses) / len(losses)


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[list[dict], object]:
    """The one spawn of 4 processes both tests read: the plain tensor-parallel phase, then the sequence-parallel one."""
    checkpoint_dir = tmp_path_factory.mktemp("tp") / "ckpt"
    return towers.spawn(_job, 4, args=(str(checkpoint_dir),), timeout_s=240), checkpoint_dir


def test_dp2_tp2_trains_as_one_device_and_its_checkpoint_loads_on_one_process(launch):
    results, checkpoint_dir = launch
    chief = results[0]
    facts = [r["facts"] for r in results]
    assert [f["chief"] for f in facts] == [True, False, False, False]
    assert {(f["replicas"], f["mesh"], f["shape"], f["tp"]) for f in facts} == {(2, ("dp_shard", "tp"), (2, 2), 2)}
    # a split layer is sharded over dp (FSDP2) and tp; the embedding over dp, replicated on the tp processes
    assert facts[0]["placements"] == [["_StridedShard", "Shard"], ["Shard", "Replicate"]]  # FSDP2 over TP's shard
    assert all(f["loss"] == facts[0]["loss"] for f in facts)  # every process reports the job's History

    reference, norms = _plain_loop()
    _close(chief["loop"], reference)
    assert chief["norms"] == pytest.approx(norms, rel=1e-5)  # torch's own clip_grad_norm_: the whole model's norm

    fit_reference, mean_loss = _plain_fit()
    _close(chief["fit"], fit_reference)
    assert facts[0]["loss"][0] == pytest.approx(mean_loss, rel=1e-5)

    model = _model()  # one process, no strategy: the tensor-parallel shards reassemble into the full tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    towers.checkpoint.restore_checkpoint(checkpoint_dir, {"model": model, "optimizer": optimizer})
    _close(model.state_dict(), reference)
    assert all(len(s["momentum_buffer"].shape) > 0 for s in optimizer.state.values())

    # and into another mesh: one replica split 4 ways
    resharded = towers.spawn(_restore_under, 4, args=("tp=4", str(checkpoint_dir)), timeout_s=240)[0]
    _close(resharded, reference)


# --- sequence parallelism: the same 4-process mesh, the norms and residual stream split on the sequence ---------------

def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _llama(transformers):
    config = transformers.LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=CONFIG.block_size, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _layout(output) -> tuple:
    """What a module's output is on this process: (DTensor placements or None, local shape)."""
    placements = tuple(type(p).__name__ + str(getattr(p, "dim", "")) for p in output.placements) \
        if hasattr(output, "placements") else None
    return placements, tuple((output.to_local() if placements else output).shape)


def _sequence_parallel_phase() -> dict:
    transformers = importlib.import_module("transformers") if _has_transformers() else None
    strategy = towers.FullyShardedStrategy(mesh="dp=2,tp=2", sequence_parallel=True)
    with strategy.scope():
        model, llama = _model(), _llama(transformers) if transformers else torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        llama_optimizer = torch.optim.SGD(llama.parameters(), lr=0.5)
    model, optimizer = strategy.prepare(model, optimizer)
    block = strategy.unwrap(model).blocks[0]
    watched = {"ln_1": block.ln_1, "block": block, "ln_f": strategy.unwrap(model).ln_f}
    if transformers:
        llama, llama_optimizer = strategy.prepare(llama, llama_optimizer)
        watched["llama_norm"] = strategy.unwrap(llama).model.layers[1].post_attention_layernorm
    seen = {}
    for name, module in watched.items():
        module.register_forward_hook(lambda _m, _i, out, name=name: seen.update({name: _layout(out)}) and None)
    x, _ = _data()

    def llama_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        strategy.backward(towers.compute_average_loss(_token_loss(llama(input_ids=xb).logits, yb)))
        llama_optimizer.step()
        llama_optimizer.zero_grad()

    norms = _custom_loop(strategy, model, optimizer, also=llama_step if transformers else None)
    loop = strategy.full_state_dict(model)
    llama_state = strategy.full_state_dict(llama) if transformers else None
    layouts = dict(seen)
    try:
        model(x[:2, :15])  # 15 tokens do not divide by tp=2
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"loop": loop, "llama": llama_state, "norms": norms, "seen": layouts, "refused": refused}


def _plain_llama_loop() -> dict:
    import transformers

    model = _llama(transformers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _data()
    for i in range(STEPS):
        _token_loss(model(input_ids=x[i * GBS:(i + 1) * GBS]).logits, y[i * GBS:(i + 1) * GBS]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_dp2_tp2_with_sequence_parallelism_trains_as_one_device(launch):
    results = [r["sequence_parallel"] for r in launch[0]]
    assert not any("error" in r for r in results), "\n".join(r.get("error", "") for r in results)
    chief = results[0]
    local = GBS // 2  # each replica's share of the batch
    half = CONFIG.block_size // 2  # each tp process's share of the sequence
    # the norms compute on half of the sequence, the residual stream between blocks is half, the final norm's output
    # is whole again (gathered for the head)
    assert {k: v for k, v in chief["seen"].items() if k != "llama_norm"} == {
        "ln_1": (("Shard1",), (local, half, 32)), "block": (None, (local, half, 32)),
        "ln_f": (None, (local, CONFIG.block_size, 32))}

    reference, norms = _plain_loop()
    _close(chief["loop"], reference)
    assert chief["norms"] == pytest.approx(norms, rel=1e-5)  # the norms' gradients summed over the sequence's halves
    assert all("sequence length must divide by tp" in r["refused"] and "15 tokens per sequence" in r["refused"]
               and "tp=2" in r["refused"] for r in results)

    pytest.importorskip("transformers")  # a Hugging Face Llama: its own plan, its sequence-parallel variant
    assert chief["seen"]["llama_norm"] == (("Shard1",), (local, half, 32))
    _close(chief["llama"], _plain_llama_loop())


# --- loss parallelism: the head's logits split over the vocabulary, the user's cross entropy on the slices -----------

def _loss_parallel_phase() -> dict:
    strategy = towers.FullyShardedStrategy(mesh="dp=2,tp=2", loss_parallel=True)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    norms, layouts = [], set()

    def weighted(out, yb):  # the tokens of a mask weigh, the others do not: one device's mean over the weighed ones
        per_token = torch.nn.functional.cross_entropy(out.flatten(0, 1), yb.flatten(), reduction="none")
        return towers.compute_average_loss(per_token.view(len(yb), -1), weights=_mask(yb))

    for xb, yb in strategy.distribute_dataset(_data(), global_batch_size=GBS, shuffle=False):
        loss, outputs = strategy.forward_backward(model, xb, yb, weighted)
        layouts.add((_layout(outputs), type(loss).__name__))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).full_tensor()))
        optimizer.step()
        optimizer.zero_grad()
    x, y = _data()
    with torch.no_grad():
        evaluated = model(x[:4])  # outside forward_backward: whole logits, as without loss parallelism
    loop = strategy.full_state_dict(model)

    with strategy.scope():
        net = _model()
        trainer = towers.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5), strategy=strategy, breakdown_every=0,
                                 loss=lambda logits, y: _token_loss(logits, y), metrics=["accuracy"])
    history = trainer.fit((x, y), epochs=1, global_batch_size=GBS, shuffle=False)
    return {"loop": loop, "norms": norms, "layouts": sorted(layouts), "evaluated": evaluated,
            "fit": strategy.full_state_dict(trainer.model), "history": {k: history[k][0] for k in ("loss", "accuracy")}}


def _mask(y: torch.Tensor) -> torch.Tensor:
    return (y % 3 != 0).float()  # about 2 tokens in 3 weigh


def _masked_mean(logits: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """One device's mean token loss over the tokens the mask weighs."""
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten(), reduction="none")
    return (per_token.view(len(yb), -1) * _mask(yb)).sum() / _mask(yb).sum()


def test_dp2_tp2_with_loss_parallelism_trains_as_one_device(launch):
    results = [r["loss_parallel"] for r in launch[0]]
    assert not any("error" in r for r in results), "\n".join(r.get("error", "") for r in results)
    chief = results[0]
    local = GBS // 2
    # the logits the loss saw: split over the vocabulary (each tp process half of it); the loss came back whole
    assert chief["layouts"] == [((("Shard0", "Shard2"), (local, CONFIG.block_size, CONFIG.vocab_size // 2)), "Tensor")] \
        or chief["layouts"] == [((("Shard2",), (local, CONFIG.block_size, CONFIG.vocab_size // 2)), "Tensor")]
    reference, norms = _plain_loop(_masked_mean)
    _close(chief["loop"], reference)
    assert chief["norms"] == pytest.approx(norms, rel=1e-5)
    model = _model()
    model.load_state_dict(reference)
    with torch.no_grad():
        torch.testing.assert_close(chief["evaluated"], model(_data()[0][:4]), rtol=RTOL, atol=ATOL)

    fit_reference, mean_loss = _plain_fit()  # the mean token loss: the mean of each sequence's mean (same lengths)
    _close(chief["fit"], fit_reference)
    assert chief["history"]["loss"] == pytest.approx(mean_loss, rel=1e-5)
    assert 0 <= chief["history"]["accuracy"] <= 1


# --- Hugging Face GPT-2: Conv1D layers, q, k and v in one layer, the head tied to the embedding ----------------------

def _gpt2(transformers):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=CONFIG.vocab_size, n_positions=CONFIG.block_size, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def _gpt2_phase() -> dict:
    if not _has_transformers():
        return {}
    transformers = importlib.import_module("transformers")
    strategy = towers.FullyShardedStrategy(mesh="dp=2,tp=2")
    with strategy.scope():
        model = _gpt2(transformers)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    norms = []
    for xb, yb in strategy.distribute_dataset(_data(), global_batch_size=GBS, shuffle=False):
        strategy.forward_backward(model, {"input_ids": xb}, yb,
                                  lambda out, yb: towers.compute_average_loss(_token_loss(out.logits, yb)))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).full_tensor()))
        optimizer.step()
        optimizer.zero_grad()
    inner = strategy.unwrap(model)
    qkv = inner.transformer.h[0].attn.c_attn.weight
    return {"state": strategy.full_state_dict(model), "norms": norms, "qkv": tuple(qkv.to_local().shape),
            "tied": inner.lm_head.weight is inner.transformer.wte.weight}


def test_hugging_face_gpt2_under_dp2_tp2_trains_as_one_device(launch):
    transformers = pytest.importorskip("transformers")
    results = [r["gpt2"] for r in launch[0]]
    assert not any("error" in r for r in results), "\n".join(r.get("error", "") for r in results)
    chief = results[0]
    assert chief["qkv"] == (32 // 2, 3 * 32 // 2)  # rows sharded over dp, q/k/v columns of 2 of the 4 heads over tp
    assert chief["tied"]  # the head is still the embedding
    model = _gpt2(transformers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = _data()
    norms = []
    for i in range(STEPS):  # the plain loop, no towers
        _token_loss(model(input_ids=x[i * GBS:(i + 1) * GBS]).logits, y[i * GBS:(i + 1) * GBS]).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    _close(chief["state"], model.state_dict())
    assert chief["norms"] == pytest.approx(norms, rel=1e-5)


# --- HSDP with tensor parallelism: 8 processes, (replicate 2, shard 2, tp 2) -----------------------------------------

def _hsdp_job() -> dict:
    strategy = towers.FullyShardedStrategy(mesh="dp=4,tp=2", shard_group_size=2)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = strategy.prepare(model, optimizer)
    norms = _custom_loop(strategy, model, optimizer)
    qkv = strategy.unwrap(model).blocks[0].attn.qkv.weight
    return {"state": strategy.full_state_dict(model), "norms": norms, "replicas": strategy.num_replicas_in_sync,
            "mesh": (tuple(strategy.mesh.mesh_dim_names), tuple(strategy.mesh.shape)),
            "placements": [type(p).__name__ for p in qkv.placements], "local": tuple(qkv.to_local().shape)}


def test_hsdp_with_tensor_parallelism_trains_as_one_device():
    results = towers.spawn(_hsdp_job, 8, timeout_s=240, threads_per_process=1)
    reference, norms = _plain_loop()
    chief = results[0]
    assert chief["mesh"] == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2)) and chief["replicas"] == 4
    # qkv: replicated across the 2 groups, its rows sharded within a group (FSDP2 over TP's split), split over tp
    assert chief["placements"] == ["Replicate", "_StridedShard", "Shard"]
    assert chief["local"] == (3 * 32 // 2 // 2, 32)
    _close(chief["state"], reference)  # gathered onto the chief
    for r in results:
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
