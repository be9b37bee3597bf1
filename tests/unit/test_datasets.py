"""Offline data: bundled digits, MNIST IDX files written by the test, clear errors on bad files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from towers.datasets import load_data_spec, load_digits, load_mnist_idx, read_idx, synthetic_images, write_idx
from towers.models import SeedCNN


def test_digits_are_upsampled_split_and_deterministic():
    train, test = load_digits(seed=3)
    x, y = train.tensors
    assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32
    assert len(train) + len(test) == 1797 and len(test) == 359
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert set(y.tolist()) == set(range(10))
    again, _ = load_digits(seed=3)
    assert torch.equal(again.tensors[1], y)
    other, _ = load_digits(seed=4)
    assert not torch.equal(other.tensors[1], y)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_mnist_idx_round_trip(tmp_path, suffix):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 5)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, (n,), dtype=np.uint8))
    train, test = load_data_spec(f"mnist:{tmp_path}")
    assert len(train) == 12 and len(test) == 5
    x, y = train.tensors
    raw = read_idx(tmp_path / f"train-images-idx3-ubyte{suffix}")
    assert torch.allclose(x[:, 0], torch.from_numpy(raw.astype(np.float32) / 255))
    assert y.dtype == torch.int64
    assert SeedCNN()(x).shape == (12, 10)


def test_idx_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(ValueError, match="is not an IDX file"):
        read_idx(bad)
    torn = write_idx(tmp_path / "torn", np.zeros((4, 3), dtype=np.uint8))
    torn.write_bytes(torn.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(torn)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist_idx(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist_idx(tmp_path / "missing")
    with pytest.raises(ValueError, match="Expected 'digits' or 'mnist:"):
        load_data_spec("imagenet")


def test_synthetic_images_shape_and_seed():
    a, b = synthetic_images(6, seed=1), synthetic_images(6, seed=1)
    assert a.tensors[0].shape == (6, 1, 28, 28)
    assert torch.equal(a.tensors[0], b.tensors[0])
