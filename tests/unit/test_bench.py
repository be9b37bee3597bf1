"""towers.bench without processes: report maths, table, JSON, plot, config and CLI validation."""

from __future__ import annotations

import json
import statistics

import pytest

from towers.bench.config import BenchConfig, parse_replicas, parse_strategies
from towers.bench.report import RAW, BenchReport, Measurement, summarize
from towers.cli import main


def make_report() -> BenchReport:
    return BenchReport(
        measurements=[
            Measurement(RAW, 1, "torch (no DDP)", (2000.0, 2100.0, 1900.0)),
            Measurement("mirrored", 1, "OneDeviceStrategy", (1980.0, 2000.0, 1995.0)),
            Measurement(RAW, 2, "torch DDP", (3000.0, 3200.0, 3400.0), (30.0, 31.0, 29.0)),
            Measurement("mirrored", 2, "MirroredStrategy", (2940.0, 3200.0, 3060.0), (30.3, 31.0, 29.58)),
        ],
        config={"repeats": 3, "steps": 30, "warmup": 5, "batch_size": 64, "threads": 1},
        environment={"cores": 2},
    )


def test_speedup_efficiency_and_ratio_follow_from_the_medians():
    report = make_report()
    assert report.get(RAW, 2).median == 3200.0
    assert report.speedup(RAW, 1) == pytest.approx(1.0)
    assert report.speedup(RAW, 2) == pytest.approx(3200.0 / 2000.0)
    assert report.efficiency(RAW, 2) == pytest.approx(3200.0 / (2 * 2000.0))
    assert report.efficiency("mirrored", 2) == pytest.approx(3060.0 / (2 * 1995.0))
    # per-repeat ratios (interleaved pairs), then their median: 0.98, 1.0, 0.9
    assert report.ratios_vs_raw("mirrored", 2) == pytest.approx([0.98, 1.0, 0.9])
    assert report.ratio_vs_raw("mirrored", 2) == pytest.approx(0.98)
    assert report.ratio_vs_raw("mirrored", 1) == pytest.approx(sorted([0.99, 2000 / 2100, 1995 / 1900])[1])
    # CPU per step: ratios 1.01, 1.0, 1.02 -> median 1.01; no CPU times at 1 replica -> None
    assert report.cpu_ratio_vs_raw("mirrored", 2) == pytest.approx(1.01)
    assert report.get("mirrored", 2).cpu_ms == pytest.approx(30.3)
    assert report.cpu_ratio_vs_raw("mirrored", 1) is None


def test_missing_baselines_give_none_not_errors():
    report = BenchReport([Measurement("mirrored", 2, "MirroredStrategy", (100.0,))])
    assert report.speedup("mirrored", 2) is None
    assert report.efficiency("mirrored", 2) is None
    assert report.ratio_vs_raw("mirrored", 2) is None
    assert report.rows()[0].vs_raw is None
    assert "-" in report.to_table()


def test_rows_are_ordered_by_replicas_with_raw_first():
    rows = make_report().rows()
    assert [(r.strategy, r.replicas) for r in rows] == [(RAW, 1), ("mirrored", 1), (RAW, 2), ("mirrored", 2)]
    assert rows[2].low == 3000.0 and rows[2].high == 3400.0 and rows[2].vs_raw is None


def test_table_is_aligned_and_shows_every_number():
    table = make_report().to_table()
    lines = table.splitlines()
    assert lines[0].split() == ["strategy", "replicas", "engine", "examples/s", "[min-max]", "speed-up",
                                "efficiency", "vs", "raw", "DDP", "CPU", "ms/step", "CPU", "vs", "raw", "peak", "MiB"]
    body = lines[2:6]
    assert len({len(line) for line in lines[:6]}) == 1, "header, rule and rows share one width"
    assert "mirrored" in body[3] and "3,060" in body[3] and "[2,940-3,200]" in body[3]
    assert "1.53x" in body[3] and "0.77" in body[3] and "0.98" in body[3]
    assert "30.3       1.010" in body[3] and body[3].endswith("-") and body[0].rstrip().endswith("-")  # no memory
    assert "median of 3 repeats of 30 steps" in table


def test_json_round_trip_keeps_measurements_and_derived_rows(tmp_path):
    report = make_report()
    path = report.to_json(tmp_path / "deep" / "bench.json")
    data = json.loads(path.read_text())
    assert data["config"]["repeats"] == 3
    assert {(r["strategy"], r["replicas"]) for r in data["rows"]} == {(RAW, 1), ("mirrored", 1), (RAW, 2), ("mirrored", 2)}
    again = BenchReport.from_json(path)
    assert again.measurements == report.measurements
    assert again.to_dict() == report.to_dict()


def test_summary_states_ratio_and_both_efficiencies():
    (one, two) = summarize(make_report())
    assert one.startswith("mirrored at 1 replica(s): towers/raw = ")
    assert "towers/raw = 0.980 (CPU per step: towers/raw = 1.010)" in two and "mirrored 0.77, raw DDP 0.80" in two


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    path = make_report().plot(tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'towers\[plot\]'.*--no-plot"):
        make_report().plot(tmp_path / "bench.png")


def test_measurement_needs_repeats_and_a_positive_replica_count():
    with pytest.raises(ValueError, match="no repeats"):
        Measurement("mirrored", 2, "x", ())
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        Measurement("mirrored", 0, "x", (1.0,))
    with pytest.raises(ValueError, match="one of each per repeat"):
        Measurement("mirrored", 1, "x", (1.0, 2.0), (3.0,))


def test_config_normalises_and_validates():
    config = BenchConfig(replicas=(2, 1), strategies=("Mirrored", "ps-async"))
    assert config.replicas == (1, 2) and config.strategies == ("mirrored", "ps_async")
    assert config.workload_spec().steps_per_epoch == config.warmup + config.steps
    for kwargs, message in [
        ({"replicas": ()}, "replicas must be positive integers"),
        ({"replicas": (1, 1)}, "must not repeat"),
        ({"strategies": ("horovod",)}, "strategies must be among"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"warmup": -1}, "warmup must be an integer >= 0"),
        ({"repeats": 0}, "repeats must be"),
        ({"interleave_steps": -1}, "interleave_steps must be an integer >= 0"),
        ({"batch_size": 0}, "batch_size must be"),
        ({"threads": 0}, "threads must be"),
        ({"optimizer": "lbfgs"}, "optimizer must be one of"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            BenchConfig(**kwargs)


def test_job_timeout_grows_with_the_work_and_with_oversubscription():
    config = BenchConfig()
    assert config.job_timeout_s(2, 2, cores=2) < config.job_timeout_s(4, 2, cores=2)
    assert BenchConfig(steps=300).job_timeout_s(2, 2, cores=2) > config.job_timeout_s(2, 2, cores=2)
    assert BenchConfig(timeout_s=7).job_timeout_s(2, 2) == 7


def test_list_flags_parse_and_reject_with_the_fix():
    assert parse_replicas("1, 2,4") == (1, 2, 4)
    assert parse_strategies("mirrored,PS-sync") == ("mirrored", "ps_sync")
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(ValueError, match="Pass e.g. --replicas 1,2"):
            parse_replicas(bad)
    with pytest.raises(ValueError, match="Received: 'nccl'"):
        parse_strategies("nccl")


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0,2"], "--replicas must be a comma-separated list of positive integers. Received: '0,2'"),
    (["--strategies", "allreduce"], "--strategies must be a comma-separated list"),
    (["--steps", "0"], "steps must be an integer >= 1. Received: 0"),
    (["--repeats", "0"], "repeats must be an integer >= 1"),
    (["--batch-size", "0"], "batch_size must be an integer >= 1"),
    (["--threads", "0"], "threads must be an integer >= 1"),
])
def test_cli_rejects_bad_flags_with_exit_code_2(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("towers bench: error: ") and message in err


def test_cli_rejects_an_out_dir_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("")
    assert main(["bench", "--out-dir", str(target)]) == 2
    assert "--out-dir must be a directory" in capsys.readouterr().err


def test_cli_rejects_a_non_integer_with_argparse_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--steps", "many"])
    assert exc.value.code == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err


class _FakeWorkload:
    num_replicas = 2

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def start_epoch(self) -> None:
        self.calls.append((self.name, "epoch"))

    def train(self, steps: int) -> None:
        self.calls.append((self.name, steps))


def test_measure_interleaved_takes_turns_abba_and_brackets_timed_chunks_with_barriers():
    from towers.bench.runner import measure_interleaved

    calls: list = []
    workloads = {RAW: _FakeWorkload(RAW, calls), "mirrored": _FakeWorkload("mirrored", calls)}
    config = BenchConfig(steps=7, warmup=2, repeats=2, interleave_steps=3, batch_size=4)
    measured = measure_interleaved(workloads, config=config, barrier=lambda: calls.append(("barrier", None)))
    assert {k: len(v["examples_per_s"]) for k, v in measured.items()} == {RAW: 2, "mirrored": 2}
    assert {k: len(v["cpu_ms_per_step"]) for k, v in measured.items()} == {RAW: 2, "mirrored": 2}
    assert all(v > 0 for values in measured.values() for v in values["examples_per_s"])
    trains = [c for c in calls if c[0] != "barrier" and c[1] != "epoch"]
    # repeat 1: warm-ups, then chunks of 3, 3, 1 steps in A B B A A B order; repeat 2 starts with B
    assert trains[:8] == [(RAW, 2), ("mirrored", 2), (RAW, 3), ("mirrored", 3), ("mirrored", 3), (RAW, 3),
                          (RAW, 1), ("mirrored", 1)]
    assert trains[8:10] == [("mirrored", 2), (RAW, 2)]
    timed = [i for i, c in enumerate(calls) if c[0] != "barrier" and c[1] in (3, 1)]
    assert all(calls[i - 1][0] == "barrier" and calls[i + 1][0] == "barrier" for i in timed)
    # no interleaving: one turn of all the steps each
    calls.clear()
    measure_interleaved(workloads, config=BenchConfig(steps=7, warmup=0, repeats=1, interleave_steps=0),
                        barrier=lambda: None)
    assert [c for c in calls if c[1] != "epoch"] == [(RAW, 0), ("mirrored", 0), (RAW, 7), ("mirrored", 7)]


def test_worker_reports_combine_into_raw_and_paired_towers_measurements():
    from towers.bench.runner import _measurements

    def report(cpu_raw, cpu_ps):
        return {"skipped": "", "measured": {
            RAW: ("torch DDP", {"examples_per_s": [100.0, 110.0], "cpu_ms_per_step": cpu_raw}),
            "ps_sync": ("ParameterServerStrategy(sync, 1 ps)", {"examples_per_s": [90.0, 99.0], "cpu_ms_per_step": cpu_ps})}}

    # rank 0 and rank 1 are workers, rank 2 a ps task (None)
    raw, ps = _measurements([report([10.0, 12.0], [11.0, 13.0]), report([14.0, 16.0], [15.0, 17.0]), None], 2,
                            "ps_sync")
    assert raw.examples_per_s == (100.0, 110.0) and raw.cpu_ms_per_step == (12.0, 14.0)
    assert ps.cpu_ms_per_step == (13.0, 15.0) and ps.raw_examples_per_s == raw.examples_per_s
    # the paired baseline wins over another job's raw row at the same replica count
    other_raw = Measurement(RAW, 2, "torch DDP", (1000.0, 1000.0), (1.0, 1.0))
    report_ = BenchReport([other_raw, ps])
    assert report_.ratios_vs_raw("ps_sync", 2) == pytest.approx([0.9, 0.9])
    assert report_.cpu_ratio_vs_raw("ps_sync", 2) == pytest.approx(statistics.median([13 / 12, 15 / 14]))
    assert BenchReport.from_dict(report_.to_dict()).measurements == report_.measurements


def test_one_replica_baselines_from_the_same_job_give_per_repeat_speedups():
    from towers.bench.runner import _measurements

    def entry(engine, throughput, cpu):
        return (engine, {"examples_per_s": throughput, "cpu_ms_per_step": cpu})

    rank0 = {"skipped": "", "measured": {
        "raw_ddp@1": entry("torch (no DDP)", [1000.0, 500.0], [20.0, 20.0]),
        "mirrored@1": entry("OneDeviceStrategy", [990.0, 500.0], [20.2, 20.0]),
        "raw_ddp": entry("torch DDP", [1600.0, 900.0], [24.0, 24.0]),
        "mirrored": entry("MirroredStrategy", [1584.0, 900.0], [23.0, 23.0])}}
    rank1 = {"skipped": "", "measured": {
        "raw_ddp@1": entry("idle", [0.0, 0.0], [0.01, 0.01]), "mirrored@1": entry("idle", [0.0, 0.0], [0.01, 0.01]),
        "raw_ddp": entry("torch DDP", [1600.0, 900.0], [26.0, 26.0]),
        "mirrored": entry("MirroredStrategy", [1584.0, 900.0], [25.0, 25.0])}}
    ms = _measurements([rank0, rank1], 2, "mirrored")
    assert [(m.strategy, m.replicas, m.engine) for m in ms] == [
        (RAW, 1, "torch (no DDP)"), ("mirrored", 1, "OneDeviceStrategy"), (RAW, 2, "torch DDP"),
        ("mirrored", 2, "MirroredStrategy")]
    assert ms[0].cpu_ms_per_step == (20.0, 20.0), "the idle rank does not dilute a 1-replica run's CPU time"
    assert ms[3].cpu_ms_per_step == (24.0, 24.0) and ms[3].base_examples_per_s == (990.0, 500.0)
    report = BenchReport(ms)
    # per repeat: 1584/990 = 1.6 and 900/500 = 1.8 -> median 1.7 (the medians' ratio would be 1242/745)
    assert report.speedup("mirrored", 2) == pytest.approx(1.7)
    assert report.efficiency(RAW, 2) == pytest.approx(statistics.median([1.6, 1.8]) / 2)
    assert report.ratio_vs_raw("mirrored", 1) == pytest.approx(statistics.median([0.99, 1.0]))
