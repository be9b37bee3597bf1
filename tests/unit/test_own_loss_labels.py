"""A model's own loss on ``(input_ids, labels)`` pairs: the labels go where the model's forward takes them.

The reference is the plain one-device Hugging Face loop, ``model(input_ids=x, labels=y).loss.backward()``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import towers
from towers.cluster.info import ProcessInfo
from towers.training.batches import labels_argument

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (the test extra installs it)")

ROWS, LENGTH, VOCAB, BATCH = 16, 8, 50, 8


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _pairs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=g)
    return ids, ids.masked_fill(torch.arange(LENGTH)[None] >= lengths[:, None], -100)  # padding not predicted


def _trainer(model: nn.Module) -> towers.Trainer:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return towers.Trainer(model, optimizer, strategy=towers.OneDeviceStrategy("cpu", info=ProcessInfo()))


def test_pairs_train_a_hugging_face_causal_lm_on_its_own_loss_as_the_plain_loop() -> None:
    ids, labels = _pairs()
    plain = _gpt2()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        for start in range(0, ROWS, BATCH):
            plain(input_ids=ids[start:start + BATCH], labels=labels[start:start + BATCH]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    trainer = _trainer(_gpt2())
    trainer.fit((ids, labels), epochs=2, global_batch_size=BATCH, shuffle=False)
    for got, want in zip(trainer.unwrapped_model.parameters(), plain.parameters()):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), float((got - want).abs().max())
    with torch.no_grad():  # evaluate takes the pairs the same way: the mean over every label token
        plain.eval()
        want_loss = plain(input_ids=ids, labels=labels).loss.item()
    assert trainer.evaluate((ids, labels), global_batch_size=ROWS)["loss"] == pytest.approx(want_loss, rel=1e-5)


class _NanoGPT(nn.Module):
    """nanoGPT's convention: ``forward(idx, targets=None)`` returns ``(logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.embed(idx)
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


class _NoLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, VOCAB)

    def forward(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed(idx)


def test_labels_go_by_position_by_name_or_are_refused_as_the_forward_takes_them() -> None:
    assert labels_argument(_NanoGPT()).keyword is None and labels_argument(_NanoGPT()).refusal is None
    gpt2 = labels_argument(_gpt2())
    assert gpt2.keyword == "labels" and gpt2.by_key == "labels"
    class Wrapper(nn.Module):  # a user's wrapper around a Hugging Face model hands its keywords on
        def forward(self, input_ids: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
            return input_ids
    assert labels_argument(Wrapper()).keyword == "labels" and labels_argument(Wrapper()).by_key is None
    refused = labels_argument(_NoLabels()).refusal
    assert refused is not None and "_NoLabels.forward(idx, mask)" in refused
    assert "Received: (x, y) batches" in refused and "dict batches" in refused and "loss=" in refused


def test_a_nanogpt_model_still_gets_its_targets_by_position() -> None:
    ids, labels = _pairs()
    trainer = towers.Trainer(_NanoGPT(), None, strategy=towers.OneDeviceStrategy("cpu", info=ProcessInfo()),
                             ignore_index=-100)
    logs = trainer.evaluate((ids, labels), global_batch_size=BATCH)
    model = _NanoGPT()
    model.load_state_dict(trainer.unwrapped_model.state_dict())
    with torch.no_grad():
        want = model(ids, labels)[1].item()  # cross_entropy's ignore_index is -100 too
    assert logs["loss"] == pytest.approx(want, rel=1e-5)


def test_pairs_for_a_forward_without_labels_are_refused_before_the_first_step() -> None:
    ids, labels = _pairs()
    model = _NoLabels()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(model)
    with pytest.raises(ValueError, match=r"takes them neither as its second argument .* nor as labels=") as caught:
        trainer.fit((ids, labels), epochs=1, global_batch_size=BATCH, shuffle=False)
    assert isinstance(caught.value, towers.TowersError)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.unwrapped_model.parameters()))  # nothing trained


def test_a_hugging_face_dict_batch_without_labels_is_refused_naming_labels_and_loss() -> None:
    ids, _ = _pairs()
    trainer = _trainer(_gpt2())
    before = [p.detach().clone() for p in trainer.unwrapped_model.parameters()]
    with pytest.raises(ValueError) as caught:
        trainer.fit({"input_ids": ids}, epochs=1, global_batch_size=BATCH, shuffle=False)
    message = str(caught.value)
    assert message.startswith("Trainer(loss=None) trains on the loss GPT2LMHeadModel computes from 'labels', and this "
                              "dict batch has none. Received: keys ['input_ids']."), message
    assert "DataCollatorForLanguageModeling(tokenizer, mlm=False)" in message and "loss=" in message
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.unwrapped_model.parameters()))
