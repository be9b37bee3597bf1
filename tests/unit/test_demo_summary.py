"""The demo's closing text: same-maths table, weak-scaling speed, and the strong-scaling line in both cases."""

from __future__ import annotations

import pytest

from towers.bench.report import BenchReport, Measurement
from towers.demo import DemoRun, DemoSpec, summary_lines


def _runs(one_per_s: float, two_per_s: float) -> list[DemoRun]:
    history = {"loss": [0.5, 0.25]}
    return [DemoRun("one_device", 1, 0.2, 0.97, 3.0, one_per_s, history),
            DemoRun("mirrored", 2, 0.2, 0.97, 4.0, two_per_s, history)]


def _weak(one: float, two: float) -> BenchReport:
    return BenchReport([Measurement("mirrored", 1, "OneDeviceStrategy", (one,)),
                        Measurement("mirrored", 2, "MirroredStrategy", (two,), base_examples_per_s=(one,))],
                       environment={"cores": 2})


def test_weak_scaling_table_and_why_strong_scaling_is_lower():
    spec = DemoSpec(epochs=2)
    lines = summary_lines(spec, _runs(3000.0, 2400.0), _weak(3000.0, 4500.0))
    text = "\n".join(lines)
    assert "       1  one_device               0.9700     0.2500      3.0" in lines
    assert "speed: weak scaling, 64 examples per replica per step" in text
    assert "       1       3,000     1.00x        1.00" in lines and "       2       4,500     1.50x        0.75" in lines
    (strong,) = [line for line in lines if line.startswith("Strong scaling")]
    assert "32 per replica) measured 0.80x: it adds no work per step" in strong
    assert "2 processes on 2 CPU cores it stays below weak scaling" in strong


def test_a_strong_scaling_number_above_weak_scaling_is_called_what_it_is():
    lines = summary_lines(DemoSpec(), _runs(1500.0, 3000.0), _weak(3000.0, 3600.0))
    (strong,) = [line for line in lines if line.startswith("Strong scaling")]
    assert "measured 2.00x, above weak scaling" in strong and "other programs on the machine" in strong


def test_without_a_speed_measurement_only_the_same_maths_table():
    lines = summary_lines(DemoSpec(scaling_repeats=0), _runs(1.0, 1.0), None)
    assert not any("weak scaling" in line for line in lines) and "loss curves coincide" in lines[-1]
    with pytest.raises(ValueError, match="--scaling-steps must be a positive integer"):
        DemoSpec(scaling_steps=0)
