"""`towers devices`: the table, --json, and the real command in its own session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

from towers.cli import main
from towers.devices import describe_devices, list_devices


def test_devices_json_lists_devices_version_and_backends(capsys):
    assert main(["devices", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch_version"] == torch.__version__
    assert [d["name"] for d in report["devices"]] == [str(d) for d in list_devices()]
    assert report["devices"][0]["torch_device"] == "cpu"
    assert report["distributed_backends"]["gloo"] == torch.distributed.is_gloo_available()
    assert set(report["distributed_backends"]) >= {"gloo", "nccl", "mpi"}


def test_devices_table(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"torch {torch.__version__} (")
    for dev in list_devices():
        assert str(dev) in out
    gloo = "yes" if torch.distributed.is_gloo_available() else "no"
    assert f"distributed backends: gloo {gloo}" in out


def test_describe_devices_reports_gpu_properties_only_for_gpus():
    report = describe_devices()
    cpu = report["devices"][0]
    assert cpu["kind"] == "cpu" and "logical cores" in cpu["description"]
    assert all(d["kind"] == "gpu" and d["total_memory_bytes"] > 0 for d in report["devices"][1:])


def test_devices_command_runs_as_a_process():
    proc = subprocess.Popen(
        [sys.executable, "-m", "towers.cli", "devices", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    assert json.loads(out)["devices"][0]["name"] == "/cpu:0"
