"""The documentation site and its coverage: mkdocs.yml builds with ``--strict`` (every page in the
navigation, every link, anchor and API reference resolved), the API reference documents every public
name of ``towers``, and every Python block of the Markdown runs in the doc tests or says why not."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import towers
from cli_support import clean_env
from doc_blocks import ROOT, markdown_files, python_blocks

_SITE_PACKAGES = ("mkdocs", "material", "mkdocstrings_handlers.python")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.timeout(300)
def test_the_site_builds_with_strict(tmp_path):
    missing = [name for name in _SITE_PACKAGES if not _importable(name)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install '.[docs]' (make install installs it)")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(site)], cwd=ROOT, env=clean_env({"NO_MKDOCS_2_WARNING": "1"}),
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert (site / "index.html").is_file() and (site / "api" / "strategies" / "index.html").is_file()


def _resolve(path: str) -> object:
    """The object a ``::: a.b.c`` line names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ImportError(path)


def test_the_api_reference_documents_every_public_name():
    pages = sorted((ROOT / "docs" / "api").glob("*.md"))
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    documented = [_resolve(path) for path in re.findall(r"^::: ([\w.]+)\s*$", text, flags=re.MULTILINE)]
    missing = []
    for name in towers.__all__:
        if name == "__version__":
            if "towers.__version__" not in text:
                missing.append(name)
            continue
        value = getattr(towers, name)
        # A `::: towers.data` entry documents the module and the members of its __all__ (towers.Shards among them).
        if not any(value is entry or (isinstance(entry, types.ModuleType) and name in getattr(entry, "__all__", ())
                                      and getattr(entry, name) is value) for entry in documented):
            missing.append(name)
    assert not missing, f"docs/api/*.md has no `::: ...` entry for towers.{', towers.'.join(missing)}"


_FENCE = re.compile(r"^```(\S*)\s*$")
# Languages a reader takes for Python; the doc tests run only ```python (and ```py) blocks.
_PYTHON_LIKE = {"python3", "py3", "pycon", "ipython", "python-repl"}
_LOOKS_LIKE_PYTHON = re.compile(r"^\s*(import \w|from [\w.]+ import |def \w+\(|class \w+[(:])", re.MULTILINE)


def _unlabelled_or_misnamed_python(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        lang, body = fence.group(1).lower(), "\n".join(lines[i + 1:j])
        if lang in _PYTHON_LIKE or (lang == "" and _LOOKS_LIKE_PYTHON.search(body)):
            found.append(f"{path.relative_to(ROOT)}:{i + 1} (```{lang})")
        i = j + 1
    return found


def test_every_python_block_runs_or_says_why_not():
    """tests/unit/test_docs.py runs every ```python block of README.md and docs/ that is not marked
    ``<!-- not-run: REASON -->``; a Python block under another fence would be skipped without a word."""
    hidden = [entry for path in markdown_files() for entry in _unlabelled_or_misnamed_python(path)]
    assert not hidden, f"Python blocks the doc tests would not run (fence them as ```python, or mark them not-run): {hidden}"
    for path in markdown_files():
        for block in python_blocks(path):
            assert block.mark != "not-run" or block.reason.strip(), f"{block.name}: <!-- not-run: REASON --> needs a reason"
