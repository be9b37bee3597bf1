"""Bad input ends with one line that says what, the value and the fix: NaN losses, input widths, stale temp files."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers


def _data(n: int = 32, width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_fit_warns_once_at_the_first_non_finite_loss_and_names_terminate_on_nan():
    x, y = _data()
    model = nn.Linear(4, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit((x * float("nan"), y), epochs=2, global_batch_size=8)
    nan_warnings = [w for w in caught if "not finite" in str(w.message)]
    assert len(nan_warnings) == 1, [str(w.message) for w in caught]
    assert "TerminateOnNaN" in str(nan_warnings[0].message)


def test_fit_with_finite_losses_does_not_warn():
    x, y = _data()
    model = nn.Linear(4, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit((x, y), epochs=1, global_batch_size=8)
    assert not [w for w in caught if "not finite" in str(w.message)]


def test_a_wrong_input_width_names_the_batch_shape_and_the_fix():
    x, y = _data(width=4)
    model = nn.Linear(5, 2)
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss=F.cross_entropy)
    with pytest.raises(ValueError, match=r"shape \(8, 4\).*in_features"):
        trainer.fit((x, y), epochs=1, global_batch_size=8)




class _TokenModel(nn.Module):
    """A model that returns (logits, its own loss): torch's token mean over labels != -100, as Hugging Face's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.embed(idx))
        return logits, F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)


def test_batches_without_a_label_token_warn_once_and_name_the_collator():
    idx = torch.randint(0, 10, (16, 5), generator=torch.Generator().manual_seed(0))
    masked = torch.full_like(idx, -100)  # a collator that masked every token
    torch.manual_seed(0)
    plain = _TokenModel()(idx[:8], masked[:8])[1]  # what the same batch gives without towers: NaN
    assert torch.isnan(plain)
    for labels, expected in ((masked, 1), (idx, 0)):
        torch.manual_seed(0)
        model = _TokenModel()
        trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = trainer.fit((idx, labels), epochs=2, global_batch_size=8)
        said = [str(w.message) for w in caught if "no label token" in str(w.message)]
        assert len(said) == expected, [str(w.message) for w in caught]
        if expected:
            assert "ignore_index=-100" in said[0] and "collator" in said[0], said[0]
            assert torch.tensor(history.history["loss"]).isnan().all(), history.history  # NaN, as plain torch's
