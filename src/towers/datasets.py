"""Data that needs no network: the digits bundled in the package, MNIST IDX files from a path, synthetic images."""

from __future__ import annotations

import gzip
import importlib.resources
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from towers.errors import InvalidArgumentError, NotFoundError

__all__ = ["load_digits", "load_digits_arrays", "DIGITS_FILE", "load_mnist_idx", "read_idx", "write_idx",
           "synthetic_images", "load_data_spec"]


#: The digits file inside the package: ``images`` uint8 ``[1797, 8, 8]`` (0..16) and ``labels`` uint8 ``[1797]``.
DIGITS_FILE = "assets/digits.npz"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Return the 1,797 bundled 8x8 digits as ``(images, labels)``: uint8 ``[N, 8, 8]`` in 0..16 and ``[N]``.

    The data (the test set of the UCI "Optical Recognition of Handwritten Digits" collection, the
    same 1,797 images as scikit-learn's ``load_digits``) ships inside the package: no network and
    no scikit-learn needed.

    Raises:
        FileNotFoundError: when the package was installed without its data file.
    """
    resource = importlib.resources.files("towers").joinpath(DIGITS_FILE)
    try:
        with resource.open("rb") as f, np.load(f, allow_pickle=False) as data:
            return data["images"].copy(), data["labels"].copy()
    except FileNotFoundError as exc:
        raise NotFoundError(
            f"towers' bundled digits ({DIGITS_FILE} inside the package) are missing. The package was built "
            "without its data: reinstall towers from a wheel or the repository (pip install -e .).") from exc


def load_digits(*, size: int = 28, test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Return ``(train, test)`` of the 1,797 bundled 8x8 digits, upsampled to ``size`` x ``size``.

    Images are float32 ``[N, 1, size, size]`` scaled to [0, 1]; labels are int64. The split is
    not stratified but deterministic for a given ``seed``.
    """
    if not 0.0 < test_fraction < 1.0:
        raise InvalidArgumentError(f"test_fraction must be in (0, 1). Received: {test_fraction}.")
    if size < 8:
        raise InvalidArgumentError(f"size must be >= 8 pixels. Received: {size}.")
    raw_images, raw_labels = load_digits_arrays()
    images = torch.from_numpy(raw_images.astype(np.float32) / 16.0).unsqueeze(1)
    if size != 8:
        images = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(raw_labels.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(labels) * test_fraction))
    test_idx, train_idx = order[:n_test], order[n_test:]
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))


_IDX_DTYPES: dict[int, Any] = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_idx(path: str | Path) -> np.ndarray:
    """Return the array stored in an IDX file (MNIST's format), gzipped or not.

    Raises:
        ValueError: when the file is not IDX (bad magic number, truncated data).
    """
    path = Path(path)
    with _open(path) as f:
        header = f.read(4)
        if len(header) != 4 or header[0] != 0 or header[1] != 0 or header[2] not in _IDX_DTYPES:
            raise InvalidArgumentError(
                f"{path} is not an IDX file: its first bytes are {header!r}, expected 00 00 <type> <ndim>. "
                "Pass MNIST's train-images-idx3-ubyte style files (optionally .gz).")
        dtype, ndim = np.dtype(_IDX_DTYPES[header[2]]), header[3]
        dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
        data = f.read()
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(data) != expected:
        raise InvalidArgumentError(
            f"{path} is truncated or corrupt: header says shape {dims} ({expected} bytes of data), "
            f"found {len(data)} bytes. Download the file again.")
    return np.frombuffer(data, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file (uint8, int8, int16, int32, float32 or float64) and return its path."""
    path = Path(path)
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
             np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}
    array = np.asarray(array)
    if array.dtype not in codes:
        raise InvalidArgumentError(f"IDX cannot hold dtype {array.dtype}. Use one of {sorted(str(d) for d in codes)}.")
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(header + body)
    return path


def load_mnist_idx(root: str | Path) -> tuple[TensorDataset, TensorDataset]:
    """Return ``(train, test)`` from MNIST IDX files in ``root`` (``train-images-idx3-ubyte[.gz]`` and friends).

    Raises:
        FileNotFoundError: naming the missing file and the names looked for.
        ValueError: when images and labels disagree in count or shape.
    """
    root = Path(root)
    if not root.is_dir():
        raise NotFoundError(f"MNIST directory {str(root)!r} does not exist. Pass the folder holding the IDX files.")

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
            if (root / name).is_file():
                return root / name
        raise NotFoundError(
            f"No {stem}[.gz] in {root}. Expected MNIST's four files: train-images-idx3-ubyte, "
            "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (optionally .gz).")

    def pair(prefix: str) -> TensorDataset:
        images = read_idx(find(f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(find(f"{prefix}-labels-idx1-ubyte"))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise InvalidArgumentError(
                f"MNIST {prefix} files disagree: images {images.shape}, labels {labels.shape}; expected "
                "[N, H, W] images and [N] labels.")
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        return TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))

    return pair("train"), pair("t10k")


def synthetic_images(n: int, *, size: int = 28, num_classes: int = 10, seed: int = 0) -> TensorDataset:
    """Return ``n`` random ``[1, size, size]`` images with random labels (for speed measurements only)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, size, size, generator=g, device="cpu"),
                         torch.randint(0, num_classes, (n,), generator=g, device="cpu"))


def load_data_spec(spec: str) -> tuple[TensorDataset, TensorDataset]:
    """Return ``(train, test)`` for a data spec: ``digits`` or ``mnist:/path/to/idx/folder``.

    Raises:
        ValueError: on an unknown spec, naming the accepted forms.
    """
    if spec == "digits":
        return load_digits()
    if spec.startswith("mnist:") and len(spec) > len("mnist:"):
        return load_mnist_idx(spec[len("mnist:"):])
    raise InvalidArgumentError(f"Unknown data {spec!r}. Expected 'digits' or 'mnist:/path/to/idx/folder'.")
