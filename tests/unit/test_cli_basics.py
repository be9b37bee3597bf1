"""The `towers` command itself: a help text written for users, --version, and `python -m towers`."""

from __future__ import annotations

import subprocess
import sys

import pytest

import towers
from towers.cli import main


def test_help_speaks_to_users(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: towers [-h] [-V] COMMAND ...")
    assert "Data-parallel training on PyTorch" in out and "examples:" in out and "towers demo" in out
    for command in ("devices", "launch", "demo", "bench", "k8s"):
        assert f"    {command} " in out
    for internal in ("main(argv)", "add_<cmd>_parser", "run_<cmd>", "spec from the parsed flags"):
        assert internal not in out


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"towers {towers.__version__} (Python ")


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: towers" in capsys.readouterr().out


def test_python_dash_m_towers_is_the_command():
    done = subprocess.run([sys.executable, "-m", "towers", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"towers {towers.__version__}")
    done = subprocess.run([sys.executable, "-m", "towers", "k8s", "--name", "Bad_Name", "--image", "i", "t.py"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--name must be a DNS-1123 label" in done.stderr
