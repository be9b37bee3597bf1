"""Real models as their users hold them, through Trainer.fit: one device's maths at any replica count and accumulation.

- A tiny Hugging Face ``GPT2LMHeadModel`` from a config (no download): right-padded dict batches
  (``input_ids``, ``attention_mask``, ``labels`` with -100), ``Trainer(model, optimizer)`` without a
  loss: the model's own token-mean loss, normalised by the GLOBAL count of label tokens.
- A tiny Hugging Face ``BertForSequenceClassification``: dict batches, the model's own loss, the
  accuracy metric on its ``logits``; ``predict`` on a dict of tensors returns the logits.
- towers' own GPT in nanoGPT's convention: ``(x, y)`` batches, ``forward(idx, targets)`` returning
  ``(logits, loss)``, padding targets -1 (``ignore_index=-1``).
- The custom loop on the same three: per-token losses normalised by
  ``compute_average_loss(per_token, weights=...)`` and clipped (GPT-2, towers' GPT), per-example
  ones by ``compute_average_loss`` (BERT), with Keras-style metrics (``update`` inside
  ``strategy.run``, ``result()`` over every replica).

Each runs on 1 process, 1 process with gradient accumulation 2, 2 Mirrored and 2 sharded
replicas: the same parameters, History and metrics.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.diagnostics.throughput import THROUGHPUT_KEYS
from towers.metrics import Mean, SparseCategoricalAccuracy
from towers.models_gpt import GPT, GPTConfig

pytest.importorskip("transformers", reason="the real-model tests need transformers (the test extra installs it)")
pytestmark = pytest.mark.timeout(300)

ROWS, LENGTH, VOCAB = 16, 8, 50


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=g)
    return ids, (torch.arange(LENGTH)[None] < lengths[:, None]).long()  # right padding


def _build(kind: str) -> tuple[nn.Module, dict, dict]:
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    ids, mask = _tokens(1)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, {}
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        labels = ids[:, 0] % 3
        return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, {"metrics": ["accuracy"]}
    targets = torch.roll(ids, -1, dims=1).masked_fill(mask == 0, -1)  # nanoGPT's convention: -1 is padding
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=2, n_embd=16))
    return model, (ids, targets), {"ignore_index": -1}


def _fit_all(accumulation: int) -> dict:
    out = {}
    for kind in ("gpt2", "bert", "gpt"):
        strategy = towers.strategy_from_env(gradient_accumulation_steps=accumulation, timeout_s=60)
        model, data, options = _build(kind)
        with strategy.scope():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # Adam would amplify float noise
        trainer = towers.Trainer(model, optimizer, strategy=strategy, **options)  # no loss=: the model's own
        history = trainer.fit(data, epochs=2, global_batch_size=8 // accumulation, shuffle=False)
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        out[kind] = {"params": [full(p).detach().clone() for p in trainer.unwrapped_model.parameters()],
                     "history": history.history}
        if kind == "bert":
            out[kind]["predict"] = trainer.predict({k: v for k, v in data.items()}, batch_size=5)
    for kind in ("gpt2", "bert", "gpt"):
        out[f"loop {kind}"] = _custom_loop(kind, accumulation)
    return out


def _custom_loop(kind: str, accumulation: int) -> dict:
    """TensorFlow's custom-training-loop tutorial, on a token-level loss with padding."""
    strategy = towers.strategy_from_env(gradient_accumulation_steps=accumulation, timeout_s=60)
    model, data, _ = _build(kind)
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        train_loss, train_accuracy = Mean("train_loss"), SparseCategoricalAccuracy("train_accuracy")
    model, optimizer = strategy.prepare(model, optimizer)
    dataset = strategy.distribute_dataset(data, 8 // accumulation, shuffle=False)

    def step(batch) -> torch.Tensor:
        if kind == "bert":  # a sequence classifier: one loss per example, the global batch's mean
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            per_example = F.cross_entropy(logits, batch["labels"], reduction="none")
            towers.compute_average_loss(per_example).backward()
            optimizer.step()
            optimizer.zero_grad()
            train_loss.update(per_example)
            train_accuracy.update(logits, batch["labels"])
            return per_example
        if kind == "gpt2":
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            labels, ignore = batch["labels"][:, 1:], -100
        else:
            (x, labels), ignore = batch, -1
            logits = model(x)
        per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=ignore, reduction="none")
        keep = labels != ignore
        loss = towers.compute_average_loss(per_token, weights=keep.float())  # the update's global token mean
        loss.backward()
        strategy.clip_grad_norm_(model.parameters(), 0.8)  # clips the first update, on the normalised gradient
        optimizer.step()
        optimizer.zero_grad()
        train_loss.update(per_token[keep])
        train_accuracy.update(logits[keep], labels[keep])
        return loss

    history = []
    for _ in range(2):
        for batch in dataset:
            strategy.run(step, args=(batch,))
        history.append((train_loss.result(), train_accuracy.result()))  # every replica's tokens
        train_loss.reset_state()
        train_accuracy.reset_state()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return {"params": [full(p).detach().clone() for p in strategy.unwrap(model).parameters()],
            "history": {"loss": [h[0] for h in history], "accuracy": [h[1] for h in history]}}


def _fit_one_process() -> tuple[dict, dict]:
    """The one-process runs, without and with accumulation, in one process (each launch costs imports)."""
    return _fit_all(1), _fit_all(2)


def test_hugging_face_and_nanogpt_models_train_with_one_devices_maths():
    one, accumulated = towers.spawn(_fit_one_process, 1, timeout_s=180)[0]
    runs = {"accumulation 2": accumulated,
            "mirrored 2": towers.spawn(_fit_all, 2, args=(1,), timeout_s=150, env={"TOWERS_STRATEGY": "mirrored"})[0],
            "sharded 2": towers.spawn(_fit_all, 2, args=(1,), timeout_s=150, env={"TOWERS_STRATEGY": "sharded"})[0]}
    for kind in ("gpt2", "bert", "gpt", "loop gpt2", "loop bert", "loop gpt"):
        assert one[kind]["history"]["loss"][1] < one[kind]["history"]["loss"][0]  # it learns
        for name, run in runs.items():
            for a, b in zip(run[kind]["params"], one[kind]["params"]):
                assert torch.allclose(a, b, atol=1e-5), (kind, name)
            for key, values in one[kind]["history"].items():
                if key in THROUGHPUT_KEYS:  # measured: differs run to run
                    continue
                assert run[kind]["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), (kind, name, key)
    assert "accuracy" in one["bert"]["history"]
    assert one["bert"]["predict"].shape == (ROWS, 3)  # the logits of every row, from a dict of tensors


def test_the_models_own_loss_is_normalised_globally_not_per_replica():
    # Two replicas whose shares hold very different numbers of label tokens: averaging per replica would
    # weigh a token of the short share more. The global normalisation gives one device's update.
    def data() -> dict:
        ids, _ = _tokens(2)
        mask = torch.ones_like(ids)
        mask[8:, 2:] = 0  # rows 8..15 (replica 1's share of each global batch of 16) keep 2 tokens of 8
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    one = towers.spawn(_one_step, 1, args=(data(),), timeout_s=120)[0]
    two = towers.spawn(_one_step, 2, args=(data(),), timeout_s=150, env={"TOWERS_STRATEGY": "mirrored"})[0]
    for a, b in zip(two, one):
        assert torch.allclose(a, b, atol=1e-6)


def _one_step(data: dict) -> list[torch.Tensor]:
    strategy = towers.strategy_from_env(timeout_s=60)
    model, _, _ = _build("gpt2")
    with strategy.scope():
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = towers.Trainer(model, optimizer, strategy=strategy)
    trainer.fit(data, epochs=1, global_batch_size=ROWS, shuffle=False)
    return [p.detach().clone() for p in trainer.unwrapped_model.parameters()]
