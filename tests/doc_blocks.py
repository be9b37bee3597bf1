"""The Python blocks of the project's Markdown files, as a reader sees them (shared by the doc tests).

Conventions in the Markdown (say them to anyone writing docs):

- every fenced block opened with ```python is run, in order, all blocks of one file in one fresh
  interpreter (later blocks may use names from earlier ones), in an empty working directory;
- a block right after the comment ``<!-- not-run: REASON -->`` is an illustration and is skipped
  (REASON must say why: it needs GPUs, a cluster, ...);
- a block right after ``<!-- same-on-2-replicas -->`` is also run on 1 and on 2 Mirrored replicas
  (``towers.spawn``), and the numbers it prints must agree: for blocks that claim "same maths".
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(not-run|same-on-2-replicas)\s*(?::\s*(.*?))?\s*-->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    code: str
    mark: str | None   # "not-run", "same-on-2-replicas" or None
    reason: str        # for "not-run"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def python_blocks(path: Path) -> list[Block]:
    """Return the ```python blocks of ``path`` with the marker comment (if any) on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang in ("python", "py"):
            previous = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            mark = _MARK.match(previous)
            blocks.append(Block(path, start + 1, "\n".join(lines[start + 1:j]) + "\n",
                                mark.group(1) if mark else None, (mark.group(2) or "") if mark else ""))
        i = j + 1
    return blocks


NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")


def run_block(name: str, code: str, work_dir: str) -> str:
    os.chdir(work_dir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    return out.getvalue()


def run_block_here(name: str, code: str, work_dir: str) -> str:
    """``run_block`` on one replica in this process (no process to start): one CPU thread, as a spawned replica
    has, and this process's working directory and random state as they were."""
    cwd, threads, rng = os.getcwd(), torch.get_num_threads(), torch.random.get_rng_state()
    torch.set_num_threads(1)
    try:
        return run_block(name, code, work_dir)
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
