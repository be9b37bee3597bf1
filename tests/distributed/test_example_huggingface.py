"""examples/huggingface.py runs as its docstring says: one process and 2 sharded replicas print the same losses.

The two runs go side by side: each spends most of its time importing transformers, on one core.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from cli_support import finish, start, towers_command

pytest.importorskip("transformers", reason="the example needs transformers (the test extra installs it)")
pytestmark = pytest.mark.timeout(200)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "huggingface.py"
_LINE = re.compile(r"(\w+): (\d) replica\(s\); loss per epoch ([\d., ]+); held-out loss ([\d.]+)")


def _losses(done) -> tuple[str, list[float]]:
    assert done.returncode == 0, done.stderr[-3000:]
    (match,) = [m for m in map(_LINE.search, done.stdout.splitlines()) if m]
    return match.group(1), [float(v) for v in match.group(3).split(", ")] + [float(match.group(4))]


def test_the_example_gives_the_same_losses_on_one_process_and_two_sharded(tmp_path):
    one, two = finish([start([sys.executable, str(EXAMPLE), "--epochs", "2"], cwd=tmp_path),
                       start([*towers_command(), "launch", "--nproc-per-node", "2", "--strategy", "sharded",
                              str(EXAMPLE), "--epochs", "2"], cwd=tmp_path)], deadline_s=150, marker=str(EXAMPLE))
    (name_one, losses_one), (name_two, losses_two) = _losses(one), _losses(two)
    assert (name_one, name_two) == ("one_device", "sharded")
    assert losses_one[1] < losses_one[0]  # it learns
    assert losses_two == pytest.approx(losses_one, abs=2e-4)
