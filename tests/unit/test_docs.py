"""Docs that run: every Python block of README.md and docs/*.md is executed as written, and the docs
point only to things inside the repository (conventions: tests/doc_blocks.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from cli_support import clean_env
from doc_blocks import ROOT, markdown_files, python_blocks

FILES_WITH_CODE = [p for p in markdown_files() if any(b.mark != "not-run" for b in python_blocks(p))]

_RUNNER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for name, code in blocks:
    print(f"--- {name}", flush=True)
    try:
        exec(compile(code, name, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {name}", file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", FILES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs_as_written(path, tmp_path):
    blocks = [b for b in python_blocks(path) if b.mark != "not-run"]
    (tmp_path / "blocks.json").write_text(json.dumps([(b.name, b.code) for b in blocks]))
    (tmp_path / "runner.py").write_text(_RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    # One torch thread: on a shared 2-core machine, two spinning intra-op threads per process can make
    # these small models train ~20x slower (the blocks' results do not depend on it).
    done = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")], cwd=work,
                          env=clean_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert [line for line in done.stdout.splitlines() if line.startswith("--- ")] == [f"--- {b.name}" for b in blocks]


def test_the_readme_has_runnable_blocks_and_skips_say_why():
    readme = python_blocks(ROOT / "README.md")
    assert any(b.mark == "same-on-2-replicas" for b in readme)
    # The README's other blocks moved to the pages of their topics, where they run as before.
    moved = [python_blocks(ROOT / "docs" / page) for page in ("getting_started.md", "checkpoints.md", "devices.md")]
    assert sum(b.mark != "not-run" for b in readme) + sum(b.mark != "not-run" for page in moved for b in page) >= 4
    assert any("trainer.fit(train_set" in b.code and b.mark != "not-run" for b in moved[0])
    assert any('CheckpointManager("ckpt/loop"' in b.code and b.mark != "not-run" for b in moved[1])
    for path in markdown_files():
        for block in python_blocks(path):
            assert block.mark != "not-run" or block.reason, f"{block.name}: <!-- not-run: REASON --> needs a reason"


_OUTSIDE = [
    (re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE), "an issue number"),
    (re.compile(r"(?<![\w/])#\d+\b"), "an issue number"),
    (re.compile(r"\bshared/|\.\./shared\b"), "a folder outside the repository"),
    (re.compile(r"\b(DESIGN|STYLE)\.md\b|\bSTYLE rule\b|\bDESIGN\b(?= (section|says))"),
     "a document outside the repository"),
]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", [*markdown_files(), ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_point_only_inside_the_repository(path):
    text = path.read_text(encoding="utf-8")
    for pattern, what in _OUTSIDE:
        found = [m.group(0) for m in pattern.finditer(text)]
        assert not found, f"{path.relative_to(ROOT)} mentions {what}: {found}"
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+://", target) or target.startswith("#") or target.startswith("mailto:"):
            continue
        local = (path.parent / target.split("#")[0]).resolve()
        assert local.exists() and ROOT in local.parents, f"{path.relative_to(ROOT)} links to {target}, not in the repository"


def site_home(readme: str) -> str:
    """docs/index.md, the documentation site's home page, from README.md: the same text, its links made
    relative to docs/, and its script skipped there (the README's own copy runs, on 1 and 2 replicas)."""
    return readme.replace("](docs/", "](").replace(
        "<!-- same-on-2-replicas -->",
        "<!-- not-run: the same block as README.md's, which the tests run on 1 and on 2 replicas -->")


def test_the_site_home_page_is_the_readme():
    home = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert home == site_home((ROOT / "README.md").read_text(encoding="utf-8")), (
        "docs/index.md must be README.md with its links relative to docs/ (regenerate it: tests/unit/test_docs.py site_home)")


def test_the_readme_prose_wraps_within_100_columns():
    """The README is read in terminals and diff views as well as on the site: its prose (not its code blocks and
    table rows, which Markdown cannot wrap) stays within 100 columns."""
    long, in_code = [], False
    for number, line in enumerate((ROOT / "README.md").read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|") and len(line) > 100:
            long.append(f"README.md:{number} ({len(line)} columns)")
    assert not long, f"wrap these README lines at 100 columns: {long}"
