"""The GPU tier's report (towers.diagnostics.gpu_report): the machine, checks read from JUnit XML, JSON and Markdown.

Runs on any machine: the environment is read as it is (on a CPU-only host: no GPU, no driver, no
NCCL), and the checks come from a JUnit file written here.
"""

from __future__ import annotations

import json

import pytest
import torch

from towers.diagnostics.gpu_report import CheckResult, Figure, GpuReport, checks_from_junit, collect_environment

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="5" time="3.0">
<testcase classname="tests.gpu.test_a" name="test_ok" file="tests/gpu/test_a.py" line="10" time="1.250" />
<testcase classname="tests.gpu.test_a" name="test_skip" file="tests/gpu/test_a.py" line="20" time="0.001">
  <skipped type="pytest.skip" message="needs a CUDA device; none is visible">tests/gpu/test_a.py:20: needs a CUDA device</skipped>
</testcase>
<testcase classname="tests.gpu.test_b" name="test_nccl[nccl]" time="0.000">
  <skipped type="pytest.skip" message="NCCL needs a GPU per rank: 2 GPUs; 1 visible" />
</testcase>
<testcase classname="tests.gpu.test_b" name="test_bad" file="tests/gpu/test_b.py" time="0.5">
  <failure message="AssertionError: scale 32768.0 != 65536.0&#10;second line">trace</failure>
</testcase>
<testcase classname="tests.gpu.test_b" name="test_fixture" file="tests/gpu/test_b.py" time="0.1">
  <error message="failed on setup with &quot;RuntimeError: CUDA error&quot;">trace</error>
</testcase>
</testsuite></testsuites>
"""


def test_checks_are_read_from_pytests_junit_xml(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    checks = checks_from_junit(path)
    assert [(c.name, c.outcome) for c in checks] == [
        ("tests/gpu/test_a.py::test_ok", "passed"),
        ("tests/gpu/test_a.py::test_skip", "skipped"),
        ("tests.gpu.test_b::test_nccl[nccl]", "skipped"),  # no file attribute: the class path
        ("tests/gpu/test_b.py::test_bad", "failed"),
        ("tests/gpu/test_b.py::test_fixture", "error"),
    ]
    assert checks[0].duration_s == 1.25
    assert checks[1].message == "needs a CUDA device; none is visible"
    assert checks[3].message == "AssertionError: scale 32768.0 != 65536.0"  # the first line only
    (tmp_path / "bad.xml").write_text("not xml")
    with pytest.raises(ValueError, match="is not JUnit XML"):
        checks_from_junit(tmp_path / "bad.xml")


def test_a_machine_without_a_gpu_says_how_many_checks_it_skipped(tmp_path):
    environment = collect_environment()
    if environment["cuda_available"]:
        pytest.skip("this machine has a CUDA device: the no-GPU summary does not apply")
    assert environment["gpu_count"] == 0 and environment["gpus"] == []
    assert environment["torch_version"] == torch.__version__
    assert environment["distributed_backends"].get("gloo") is True
    checks = [CheckResult("tests/gpu/test_a.py::test_x", "skipped", 0.0, "needs a CUDA device; none is visible"),
              CheckResult("tests/gpu/test_a.py::test_y", "skipped", 0.0, "needs a CUDA device; none is visible"),
              CheckResult("tests/unit/test_gpu_selection.py::test_z", "passed", 0.01)]
    report = GpuReport(environment=environment, checks=checks)
    assert report.ok and report.counts == {"passed": 1, "failed": 0, "error": 0, "skipped": 2}
    assert report.summary() == "no CUDA device: 2 checks skipped; 1 passed"
    data = json.loads(report.write_json(tmp_path / "r.json").read_text())
    assert data["summary"] == report.summary() and data["ok"] is True
    assert data["checks"][0] == {"name": "tests/gpu/test_a.py::test_x", "outcome": "skipped", "duration_s": 0.0,
                                 "message": "needs a CUDA device; none is visible"}
    text = report.write_markdown(tmp_path / "r.md").read_text()
    assert "**no CUDA device: 2 checks skipped; 1 passed**" in text
    assert "| GPUs | none visible |" in text
    assert "| tests/gpu/test_a.py::test_x | skipped | 0.00 | needs a CUDA device; none is visible |" in text


def test_a_gpu_run_names_the_gpu_counts_failures_and_lists_figures():
    environment = {"cuda_available": True, "gpu_count": 1, "torch_version": "2.11.0+cu130", "cuda_version": "13.0",
                   "driver_version": "580.159.04", "nccl_version": "2.27.7",
                   "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "90", "total_memory_gib": 79.2,
                             "multiprocessors": 132}]}
    report = GpuReport(environment=environment, checks=[
        CheckResult("a::ok", "passed", 1.0), CheckResult("a::nccl", "skipped", 0.0, "NCCL needs 2 GPUs"),
        CheckResult("a::bad", "failed", 2.0, "AssertionError: x | y")])
    report.figures.append(Figure("towers bench: mirrored on 1 replica(s)", 51234.5, "examples/s",
                                 "towers bench --replicas 1", "0.93x raw torch"))
    assert not report.ok
    assert report.summary() == "NVIDIA H100 80GB HBM3: 1 passed, 1 failed, 1 skipped"
    text = report.to_markdown()
    assert "| GPUs | 0: NVIDIA H100 80GB HBM3 (79.2 GiB, sm_90) |" in text
    assert "| NVIDIA driver | 580.159.04 |" in text and "| NCCL | 2.27.7 |" in text
    assert "| a::bad | failed | 2.00 | AssertionError: x \\| y |" in text  # a pipe does not split the cell
    assert ("| towers bench: mirrored on 1 replica(s) | 51,234.5 examples/s (0.93x raw torch) | "
            "`towers bench --replicas 1` |") in text


def test_check_results_refuse_unknown_outcomes():
    with pytest.raises(ValueError, match="outcome must be one of"):
        CheckResult("a::b", "xfailed", 0.0)
    with pytest.raises(ValueError, match="duration_s must be >= 0"):
        CheckResult("a::b", "passed", -1.0)
