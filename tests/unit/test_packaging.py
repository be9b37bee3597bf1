"""What a user installs: license file and metadata, package data that exists, dependencies that are needed."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from doc_blocks import ROOT
from towers.datasets import DIGITS_FILE, load_digits, load_digits_arrays

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_license_file_and_spdx_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression (the current form), not a {text = } table
    assert PROJECT["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in PROJECT.get("classifiers", []))  # superseded by the expression


def test_every_package_data_pattern_matches_a_file():
    for package, patterns in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        base = ROOT / "src" / package
        for pattern in patterns:
            assert list(base.glob(pattern)), f"package-data {package}: {pattern!r} matches nothing under {base}"
    assert (ROOT / "src" / "towers" / DIGITS_FILE).stat().st_size < 100_000


def test_dependencies_and_test_extra():
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in PROJECT["dependencies"]]
    assert "scikit-learn" not in names and "torch" in names and "pyyaml" in names
    test_extra = " ".join(PROJECT["optional-dependencies"]["test"]).lower()
    for needed in ("pytest", "pyyaml", "torchmetrics", "kubernetes-validate", "matplotlib"):
        assert needed in test_extra


def test_digits_load_without_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # any `import sklearn` now fails
    images, labels = load_digits_arrays()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and int(images.max()) == 16
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    train, test = load_digits()
    assert len(train) == 1438 and len(test) == 359
