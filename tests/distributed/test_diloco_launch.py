"""`towers launch --strategy ps` runs DiLoCo as a user would: the README's train.py unchanged under
``--strategy-option mode=diloco``, and examples/diloco.py as its docstring runs it (shortened to 2 epochs).

The real command in a new session with a deadline, no process left behind (``cli_support.run``).
"""

from __future__ import annotations

import re

import pytest

from cli_support import run, towers_command
from doc_blocks import ROOT, python_blocks

pytestmark = pytest.mark.timeout(240)

DEADLINE_S = 120.0
LAUNCH = ["launch", "--strategy", "ps", "--num-ps", "1", "--nproc-per-node", "3"]


def test_readme_script_runs_unchanged_under_diloco(tmp_path):
    readme = [b for b in python_blocks(ROOT / "README.md") if b.mark == "same-on-2-replicas"][0]
    script = tmp_path / "train.py"
    script.write_text(readme.code)
    result = run([*towers_command(), *LAUNCH, "--strategy-option", "mode=diloco", "--strategy-option", "sync_every=4",
                  str(script)], cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(v) for v in re.findall(r"epoch \d+: last step's loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], result.stdout
    # the chief's end-of-job line: DiLoCo's steps and bytes per example (3 epochs of 1438 examples, 2 workers)
    match = re.search(r"diloco: (\d+) inner step\(s\), (\d+) outer step\(s\) \(sync_every 4, float32\), (\d+) "
                      r"example\(s\); ([0-9.]+) bytes sent per example", result.stdout + result.stderr)
    assert match is not None, result.stdout + result.stderr
    inner, outer, examples = (int(match.group(i)) for i in (1, 2, 3))
    assert (inner, outer, examples) == (3 * 23, 3 * 6, 3 * 719)  # 23 steps per epoch: windows 4,4,4,4,4,3


def test_diloco_example_trains_and_reports_its_bytes(tmp_path):
    example = ROOT / "examples" / "diloco.py"
    result = run([*towers_command(), *LAUNCH, str(example), "--epochs", "2", "--compression", "int8"],
                 cwd=tmp_path, deadline_s=DEADLINE_S, marker=str(example))
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"diloco H=8 int8 fragments=1: val accuracy ([0-9.]+), final loss [0-9.]+, (\d+) bytes sent "
                      r"per example", result.stdout)
    assert match is not None, result.stdout + result.stderr
    accuracy, per_example = float(match.group(1)), int(match.group(2))
    assert accuracy > 0.8
    # the seed CNN's 1.39 MB of float32 parameters, as int8 once per 8 steps of 32 examples: ~1.4 kB per example
    assert 500 < per_example < 3000
