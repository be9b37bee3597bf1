"""The habits users bring, each against the loop they would write WITHOUT towers (plain torch, Hugging Face).

- A Hugging Face model trained by ``Trainer(model, optimizer)`` on its own loss (GPT-2, Llama, BERT, T5)
  against the plain one-device loop ``model(**batch).loss.backward()``: a causal LM's loss counts the
  shifted labels, and so must the update's normalisation. With and without accumulation. GPT-2 also on
  ``(input_ids, labels)`` pairs, against ``model(input_ids=x, labels=y).loss.backward()``.
- ``compute_average_loss(per_token, weights=)`` followed by torch's own ``clip_grad_norm_`` (nanoGPT, Hugging
  Face loops and torchtitan call it and log its norm): ``p.grad`` must be final when backward returns.
- A per-replica mean loss (``strategy.backward(out.loss)``, Accelerate's habit): one error naming
  ``compute_average_loss`` at the first step where replicas sum their gradients; ``Trainer(loss=...)`` with a
  loss that returns a mean trains one device's update.
- ``torch.manual_seed`` once: the same initial weights everywhere, each replica its own random stream from its
  first step on (replica 0 the script's own, as the plain loop draws).
- ``strategy.load_state_dict`` of a state without optimizer state into an optimizer: refused.

Each job returns what it trained; the parent compares with the plain loop computed here, in the test process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers

pytest.importorskip("transformers", reason="the habit tests need transformers (the test extra installs it)")
pytestmark = pytest.mark.timeout(300)

ROWS, LENGTH, VOCAB, BATCH = 16, 8, 50, 8
KINDS = ("gpt2", "llama", "bert", "t5")
CLIP = 0.05  # small enough that every update is clipped


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=g)
    return ids, (torch.arange(LENGTH)[None] < lengths[:, None]).long()  # right padding


def _hf(kind: str) -> tuple[nn.Module, dict]:
    """A tiny Hugging Face model from a config (no download, dropout off) and its padded dict data."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    ids, mask = _tokens()
    labels = ids.masked_fill(mask == 0, -100)
    data = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if kind == "gpt2":
        model: nn.Module = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))
    elif kind == "bert":
        model = BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        data["labels"] = ids[:, 0] % 3
    else:  # an encoder-decoder: its loss predicts every label (the decoder's inputs are the labels shifted right)
        model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                    num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                                    pad_token_id=0))
    return model, data


def _plain_hf(kind: str, epochs: int = 2) -> list[torch.Tensor]:
    """The loop a Hugging Face user writes on one device: the model's own loss, batches of 8 in order."""
    model, data = _hf(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(epochs):
        for start in range(0, ROWS, BATCH):
            model(**{k: v[start:start + BATCH] for k, v in data.items()}).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _token_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small token model (embedding, MLP, head) and padded next-token data: what nanoGPT-style loops train."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, VOCAB))
    ids, mask = _tokens()
    targets = torch.roll(ids, -1, dims=1).masked_fill(mask == 0, -100)
    return model, ids, targets


def _plain_clip(accumulation: int) -> tuple[list[torch.Tensor], list[float]]:
    """nanoGPT's loop on one device: the update's token mean, torch's clip_grad_norm_ once per update."""
    model, ids, targets = _token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for start in range(0, ROWS, BATCH):
        x, y = ids[start:start + BATCH], targets[start:start + BATCH]
        F.cross_entropy(model(x).transpose(1, 2), y, ignore_index=-100).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def _towers_clip(strategy: towers.Strategy, accumulation: int) -> tuple[list[torch.Tensor], list[float]] | str:
    """The same loop under towers: compute_average_loss(weights=), then torch's own clip (not the strategy's)."""
    model, ids, targets = _token_model()
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = strategy.prepare(model, optimizer)
    norms = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_token = F.cross_entropy(model(x).transpose(1, 2), y, ignore_index=-100, reduction="none")
        strategy.backward(towers.compute_average_loss(per_token, weights=(y != -100).float()))
        if optimizer.is_update_step if hasattr(optimizer, "is_update_step") else True:
            norms.append(float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))))
        optimizer.step()
        optimizer.zero_grad()

    try:
        for x, y in strategy.distribute_dataset((ids, targets), BATCH // accumulation, shuffle=False):
            strategy.run(step, args=(x, y))
    except ValueError as exc:
        return str(exc)
    return [_full(p) for p in strategy.unwrap(model).parameters()], norms


def _mean_loss_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), x, y


def _plain_mean_loss() -> list[torch.Tensor]:
    model, x, y = _mean_loss_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for start in range(0, ROWS, BATCH):
        F.cross_entropy(model(x[start:start + BATCH]), y[start:start + BATCH]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _towers_mean_loss(strategy: towers.Strategy) -> dict:
    """Accelerate's habit (a per-replica mean, backpropagated as it is) and Trainer(loss=) with a mean loss."""
    model, x, y = _mean_loss_model()
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = strategy.prepare(model, optimizer)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        strategy.backward(F.cross_entropy(model(xb), yb))  # a mean over this replica's share
        optimizer.step()
        optimizer.zero_grad()

    out: dict = {}
    try:
        for xb, yb in strategy.distribute_dataset((x, y), BATCH, shuffle=False):
            strategy.run(step, args=(xb, yb))
        out["loop"] = [_full(p) for p in strategy.unwrap(model).parameters()]
    except ValueError as exc:
        out["loop"] = str(exc)
        optimizer.zero_grad()  # the refused step's gradients
    model, x, y = _mean_loss_model()
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = towers.Trainer(model, optimizer, loss=lambda pred, target: F.cross_entropy(pred, target),
                             strategy=strategy)
    out["trainer"] = _attempt(lambda: (trainer.fit((x, y), epochs=1, global_batch_size=BATCH, shuffle=False),
                                       [_full(p) for p in trainer.unwrapped_model.parameters()])[1])
    return out


def _streams(strategy: towers.Strategy) -> dict:
    """Random draws after the script's one seed: initial weights and a step's dropout mask."""
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = [_full(p) for p in model.parameters()]
    model, optimizer = strategy.prepare(model, optimizer)
    x = torch.ones(BATCH, 4)

    def step(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        draw = torch.rand(4)
        out = model(xb)
        strategy.backward(towers.compute_average_loss(out.sum(dim=1)))
        optimizer.step()
        optimizer.zero_grad()
        return draw, (out != 0).detach().clone()

    steps = [strategy.run(step, args=(xb,)) for xb in strategy.distribute_dataset(x, BATCH, shuffle=False)]
    return {"initial": initial, "draw": steps[0][0], "mask": steps[0][1]}


def _plain_streams() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
    initial = [p.detach().clone() for p in model.parameters()]
    draw = torch.rand(4)
    return {"initial": initial, "draw": draw, "mask": (model(torch.ones(BATCH, 4)) != 0)}


def _partial_state(strategy: towers.Strategy) -> str:
    """A state saved without its optimizer, loaded into a model and an optimizer: refused, nothing restarted silently."""
    model, _, _ = _mean_loss_model()
    with strategy.scope():
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = strategy.prepare(model, optimizer)
    state = strategy.state_dict(model)  # no optimizer given: the state holds none
    try:
        strategy.load_state_dict(state, model, optimizer)
    except towers.checkpoint.CheckpointError as exc:
        return str(exc)
    return "loaded"


def _attempt(fn, *args):  # noqa: ANN001, ANN202 (one habit's result, or its error as text: the others still run)
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return f"error: {type(exc).__name__}: {exc}"


def _habits(accumulations: tuple[int, ...]) -> dict | None:
    out: dict = {}
    if os.environ.get("TOWERS_STRATEGY") in ("ps", "hybrid"):  # torch's clip only, on a worker
        strategy = towers.strategy_from_env(mode="sync", timeout_s=60, exit_on_ps=False)
        if getattr(strategy, "is_ps", False):
            return None
        try:
            out["clip 1"] = _towers_clip(strategy, 1)
        finally:
            strategy.shutdown()  # tells the ps tasks this worker is done
        return out
    for accumulation in accumulations:
        strategy = towers.strategy_from_env(gradient_accumulation_steps=accumulation, timeout_s=60)
        for kind in KINDS:
            model, data = _hf(kind)
            with strategy.scope():
                optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
            out[f"{kind} {accumulation}"] = _attempt(_hf_trainer, strategy, model, optimizer, data, accumulation)
        out[f"clip {accumulation}"] = _attempt(_towers_clip, strategy, accumulation)
    strategy = towers.strategy_from_env(timeout_s=60)
    out["pairs gpt2"] = _attempt(_hf_pairs, strategy)
    out["mean loss"] = _towers_mean_loss(strategy)
    out["streams"] = _streams(strategy)
    out["partial state"] = _partial_state(strategy)
    return out


def _hf_trainer(strategy: towers.Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, data: dict,
                accumulation: int) -> list[torch.Tensor]:
    trainer = towers.Trainer(model, optimizer, strategy=strategy)  # no loss=: the model's own
    trainer.fit(data, epochs=2, global_batch_size=BATCH // accumulation, shuffle=False)
    return [_full(p) for p in trainer.unwrapped_model.parameters()]


def _hf_pairs(strategy: towers.Strategy) -> list[torch.Tensor]:
    """GPT-2 on ``(input_ids, labels)`` pairs, no loss=: the labels go to the model as ``labels=``."""
    model, data = _hf("gpt2")
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = towers.Trainer(model, optimizer, strategy=strategy)
    trainer.fit((data["input_ids"], data["labels"]), epochs=2, global_batch_size=BATCH, shuffle=False)
    return [_full(p) for p in trainer.unwrapped_model.parameters()]


def _plain_pairs() -> list[torch.Tensor]:
    model, data = _hf("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        for start in range(0, ROWS, BATCH):
            x, y = data["input_ids"][start:start + BATCH], data["labels"][start:start + BATCH]
            model(input_ids=x, labels=y).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _close(got: list[torch.Tensor] | str, want: list[torch.Tensor], what: str) -> None:
    assert not isinstance(got, str), (what, got)
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= 1e-5 * scale + 1e-7, (what, float((a - b).abs().max()), scale)


@pytest.fixture(scope="module")
def runs() -> dict:
    one = towers.spawn(_habits, 1, args=((1, 2),), timeout_s=240)[0]
    mirrored = towers.spawn(_habits, 2, args=((1, 2),), timeout_s=240, env={"TOWERS_STRATEGY": "mirrored"})
    sharded = towers.spawn(_habits, 2, args=((1,),), timeout_s=240, env={"TOWERS_STRATEGY": "sharded"})
    return {"one process": [one], "mirrored 2": mirrored, "sharded 2": sharded}


@pytest.mark.parametrize("kind", KINDS)
def test_a_hugging_face_models_own_loss_trains_as_the_plain_loop(runs: dict, kind: str) -> None:
    want = _plain_hf(kind)
    for name, ranks in runs.items():
        for key in (k for k in ranks[0] if k.startswith(f"{kind} ")):
            _close(ranks[0][key], want, f"{name}, {key}")


def test_input_ids_and_labels_pairs_train_on_the_models_own_loss_as_the_plain_loop(runs: dict) -> None:
    want = _plain_pairs()
    for name, ranks in runs.items():
        for rank in ranks:
            _close(rank["pairs gpt2"], want, f"{name}, (input_ids, labels) pairs")


def test_torchs_own_clip_sees_the_final_gradient(runs: dict) -> None:
    want, norms = _plain_clip(1)
    assert all(n > CLIP for n in norms)  # every update is clipped: a wrong norm would change the parameters
    for name, ranks in runs.items():
        for key in (k for k in ranks[0] if k.startswith("clip ")):
            for rank in ranks:
                assert not isinstance(rank[key], str), (name, key, rank[key])
                got, got_norms = rank[key]
                assert got_norms == pytest.approx(norms, rel=1e-5), (name, key)
                _close(got, want, f"{name}, {key}")


def test_torchs_own_clip_under_parameter_servers() -> None:
    want, norms = _plain_clip(1)
    hybrid = towers.spawn(_habits, 3, args=((1,),), timeout_s=180,
                          env={"TOWERS_STRATEGY": "hybrid", "TOWERS_NUM_PS": "1"})
    for rank in hybrid[:2]:  # dense layers all-reduced among the workers: p.grad is the gradient
        assert not isinstance(rank["clip 1"], str), rank["clip 1"]
        got, got_norms = rank["clip 1"]
        assert got_norms == pytest.approx(norms, rel=1e-5)
        _close(got, want, "hybrid")
    ps = towers.spawn(_habits, 3, args=((1,),), timeout_s=180, env={"TOWERS_STRATEGY": "ps", "TOWERS_NUM_PS": "1"})
    for rank in ps[:2]:  # p.grad is a worker's share: the clip is refused, never trained on in silence
        assert isinstance(rank["clip 1"], str) and "clip_grad_norm_" in rank["clip 1"], rank["clip 1"]
        assert "SHARE" in rank["clip 1"]


def test_a_mean_loss_is_refused_where_replicas_sum_and_trained_exactly_by_the_trainer(runs: dict) -> None:
    want = _plain_mean_loss()
    _close(runs["one process"][0]["mean loss"]["loop"], want, "one process, plain mean loss")
    for name in ("mirrored 2", "sharded 2"):
        for rank in runs[name]:
            message = rank["mean loss"]["loop"]
            assert isinstance(message, str) and "compute_average_loss" in message and "2 replicas" in message, message
    for name, ranks in runs.items():
        for rank in ranks:
            _close(rank["mean loss"]["trainer"], want, f"{name}, Trainer(loss=mean)")


def test_replicas_start_from_one_seed_and_draw_their_own_streams(runs: dict) -> None:
    plain = _plain_streams()
    for name, ranks in runs.items():
        chief = ranks[0]["streams"]
        _close(chief["initial"], plain["initial"], name)
        assert torch.equal(chief["draw"], plain["draw"]), name  # replica 0 draws as the plain loop does
        for other in ranks[1:]:
            _close(other["streams"]["initial"], plain["initial"], name)  # the same initial weights everywhere
            assert not torch.equal(other["streams"]["draw"], chief["draw"]), name  # a stream of its own
            assert not torch.equal(other["streams"]["mask"], chief["mask"]), name  # its own dropout masks
    assert torch.equal(runs["one process"][0]["streams"]["mask"], plain["mask"])  # the plain loop's masks


def test_a_state_without_optimizer_state_is_not_loaded_into_an_optimizer(runs: dict) -> None:
    for name, ranks in runs.items():
        for rank in ranks:
            assert "holds no optimizer state" in rank["partial state"], (name, rank["partial state"])
