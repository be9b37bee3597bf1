"""Throughput and MFU: model FLOPs against hand counts, the peak table, the CPU's measured peak, the Trainer's
epoch logs and progress line, the custom-loop ThroughputMeter, and `towers bench`'s report."""

from __future__ import annotations

import io
import logging
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towers
from towers.bench.report import RAW, BenchReport, Measurement
from towers.diagnostics import peak as peak_module
from towers.diagnostics import throughput as throughput_module
from towers.diagnostics.flops import batch_shape, count_flops
from towers.diagnostics.peak import compute_dtype, device_peak, gpu_peak, measured_cpu_peak
from towers.models import SeedCNN
from towers.models_gpt import GPT, GPTConfig

# SeedCNN, per example (a multiply-add is 2 FLOPs; a backward computes the weight gradient and, except for the first
# layer, whose input needs none, the input gradient: each costs what the forward product did):
#   conv 1->32, 3x3, 26x26 outputs: forward 2*32*26*26*9 = 389,376; backward (weights only) 389,376
#   Linear(5408, 64) + Linear(64, 10): forward 2*(5408*64 + 64*10) = 693,504; backward 2 * 693,504
SEED_CNN_FLOPS = 2 * (2 * 32 * 26 * 26 * 9) + 3 * (2 * (5408 * 64 + 64 * 10))  # 2,859,264


def gpt_flops_per_token(c: GPTConfig, t: int) -> int:
    """6N + 12*L*d*T: N the weights of the matmuls (12*d^2 per block: qkv 3d^2, proj d^2, MLP 8d^2; the head d*V),
    times 2 FLOPs x 3 (forward, and a backward of twice the forward); attention QK^T and AV are 2*2*T*d per token
    and layer forward (the full square, causal or not), x3 with the backward = 12*L*d*T."""
    n = 12 * c.n_layer * c.n_embd ** 2 + c.n_embd * c.vocab_size
    return 6 * n + 12 * c.n_layer * c.n_embd * t


def test_seed_cnn_flops_match_the_hand_count():
    model, x, y = SeedCNN(), torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    _, flops = count_flops(lambda: F.cross_entropy(model(x), y).backward())
    assert SEED_CNN_FLOPS == 2_859_264
    assert flops / 4 == pytest.approx(SEED_CNN_FLOPS, rel=0.05)


def test_the_69_5m_gpt_flops_match_6n_plus_the_attention_term():
    # On the meta device: shapes only, no memory or compute (batch 2, 64 tokens, as a real step would count them).
    config = GPTConfig.small()
    with torch.device("meta"):
        model = GPT(config)
        idx = torch.randint(0, config.vocab_size, (2, 64))
    assert model.num_parameters() == 69_484_032  # the 69.5M GPT
    meter = towers.ThroughputMeter()
    with meter.step((idx, idx)):
        model(idx, idx)[1].backward()
    expected = gpt_flops_per_token(config, 64)  # 382,205,952 per token; 48.9 GFLOPs for the 128 tokens
    assert meter.flops_per_token == pytest.approx(expected, rel=0.05)
    assert meter.flops_per_example == pytest.approx(expected * 64, rel=0.05)
    # 6N with N the non-embedding parameters (biases and norms included) is the same within 1%
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte", "wpe")))
    assert meter.flops_per_token == pytest.approx(6 * n + 12 * 8 * 768 * 64, rel=0.01)


def test_batch_shape_reads_rows_and_tokens_as_models_are_fed():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert batch_shape((ids, ids)) == batch_shape({"input_ids": ids, "labels": ids}) == batch_shape(ids)
    assert batch_shape(ids).rows == 3 and batch_shape(ids).tokens == 21
    assert batch_shape((torch.randn(5, 1, 28, 28), torch.zeros(5))).tokens is None  # images: no tokens
    assert batch_shape({"x": torch.randn(4, 2)}).rows == 4
    assert batch_shape((torch.zeros(6, 3, dtype=torch.long),)).tokens == 18


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5), ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
    ("NVIDIA H100 PCIe", "fp16", 756.5), ("NVIDIA H100 NVL", "bf16", 835.5), ("NVIDIA H200", "bf16", 989.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0), ("NVIDIA A100-PCIE-40GB", "fp32", 19.5), ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40S", "bf16", 362.05), ("NVIDIA A10G", "tf32", 62.5), ("Tesla V100-SXM2-16GB", "fp16", 125.0),
    ("Tesla V100-PCIE-32GB", "tf32", 14.0),  # no TF32 on a V100: float32 matmuls run at the FP32 rate
])
def test_the_peak_table_matches_datasheet_figures(name, dtype, tflops):
    peak = gpu_peak(name, dtype)
    assert peak is not None and peak.flops_per_second == pytest.approx(tflops * 1e12)
    assert "datasheet" in peak.label and not peak.measured


def test_unknown_gpus_and_dtypes_have_no_peak_and_32_bit_picks_tf32_as_torch_does():
    assert gpu_peak("NVIDIA GeForce GTX 1080", "fp32") is None
    assert gpu_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert compute_dtype("bf16", torch.device("cuda")) == "bf16" and compute_dtype("32", torch.device("cpu")) == "fp32"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert compute_dtype("32", torch.device("cuda")) == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert compute_dtype("32", torch.device("cuda")) == "fp32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_cpu_peak_is_measured_once_positive_and_labelled():
    peak = measured_cpu_peak()
    assert peak.measured and peak.flops_per_second > 1e8 and "measured" in peak.label
    assert device_peak("cpu") is peak  # cached per process (and thread count)


def test_the_cpu_peak_is_the_best_of_its_timed_matmuls(monkeypatch):
    """The rule, on injected times (a matmul timed against the measured peak would compare two moments of a machine
    whose load changes between them): the fastest of the timed matmuls, after a warm-up that is not timed."""
    ticks = iter([10.0, 10.5, 11.0, 11.25, 12.0, 12.75])  # three timed matmuls: 0.5 s, 0.25 s, 0.75 s

    class _Clock:
        @staticmethod
        def perf_counter() -> float:
            return next(ticks)

    monkeypatch.setattr(peak_module, "time", _Clock)
    monkeypatch.setattr(peak_module, "_measured", {})
    peak = measured_cpu_peak(size=8, repeats=3)
    assert peak.flops_per_second == 2 * 8 ** 3 / 0.25 and peak.measured
    assert next(ticks, None) is None  # each timed matmul read the clock twice; the warm-up did not


def test_measuring_the_cpu_peak_draws_nothing_from_the_users_random_stream():
    """A resumed run measures the peak at its first step, the uninterrupted one at step 1: a draw from torch's global
    generator there would give the two runs other dropout masks and shuffles after it."""
    torch.manual_seed(5)
    before = torch.get_rng_state()
    measured_cpu_peak(size=64, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


def _images(n: int = 64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_fit_logs_examples_per_second_and_mfu_and_counts_the_hand_flops():
    x, y = _images()
    torch.manual_seed(0)
    model = SeedCNN()
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), F.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"))
    start = time.perf_counter()
    history = trainer.fit((x, y), 2, 16)  # 4 steps per epoch
    wall = time.perf_counter() - start
    assert trainer.throughput.flops_per_example == pytest.approx(SEED_CNN_FLOPS, rel=0.05)  # the real first step
    assert "tokens_per_second" not in history.history  # not a token model
    for epoch in range(2):
        eps, mfu = history["examples_per_second"][epoch], history["mfu"][epoch]
        assert eps > 64 / wall  # the training steps alone: faster than the whole fit
        assert 0 < mfu <= 1
        # MFU = FLOPs/s achieved / peak, with the FLOPs counted and the CPU's measured peak
        assert mfu == pytest.approx(eps * SEED_CNN_FLOPS / measured_cpu_peak().flops_per_second, rel=1e-6)


def test_fit_on_a_token_model_logs_tokens_per_second_and_the_progress_bar_shows_all_three():
    config = GPTConfig.tiny()  # vocabulary 97, context 16, 2 layers of width 32
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (32, config.block_size + 1), generator=g)
    torch.manual_seed(0)
    model = GPT(config)
    trainer = towers.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ignore_index=-1,
                             strategy=towers.OneDeviceStrategy("cpu"))  # loss=None: nanoGPT's model(idx, targets)
    out = io.StringIO()
    history = trainer.fit((tokens[:, :-1], tokens[:, 1:]), 1, 8, callbacks=[towers.callbacks.ProgressBar(stream=out)])
    assert history["tokens_per_second"][0] == pytest.approx(history["examples_per_second"][0] * config.block_size)
    assert trainer.throughput.flops_per_token == pytest.approx(gpt_flops_per_token(config, config.block_size), rel=0.05)
    assert 0 < history["mfu"][0] <= 1
    line = out.getvalue()
    assert "examples/s" in line and "tokens/s" in line and "MFU" in line and "of the measured CPU peak" in line
    assert "examples_per_second" not in line  # shown once, in words


def test_a_compiled_model_is_counted_eagerly_once_and_compiled_after():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, y = _images(32)
    torch.manual_seed(0)
    model = SeedCNN()
    trainer = towers.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), F.cross_entropy,
                             strategy=towers.OneDeviceStrategy("cpu"), compile={"backend": "aot_eager"})
    trainer.fit((x, y), 1, 8)
    assert trainer.throughput.flops_per_example == pytest.approx(SEED_CNN_FLOPS, rel=0.05)
    # A frame Dynamo first meets under the counter's dispatch mode would never be compiled: it is, after.
    assert counters["frames"]["ok"] >= 1


def test_the_custom_loop_meter_times_its_steps_and_leaves_out_the_counted_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
    meter = towers.ThroughputMeter(peak_flops=1e12)

    def step():
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    with meter.step((x, y)):  # counted: forward 2*(20*30 + 30*5), backward 2*30*5 + 2*30*5 + 2*20*30 (no input grad)
        step()
    assert meter.flops_per_example == 2 * (20 * 30 + 30 * 5) + 2 * (2 * 30 * 5) + 2 * 20 * 30
    start = time.perf_counter()
    for _ in range(20):
        with meter.step((x, y)):
            step()
    plain = 20 * 8 / (time.perf_counter() - start)  # what a user timing the steps after the counted one measures
    logs = meter.summary()
    assert set(logs) == {"examples_per_second", "mfu"}
    assert 0.8 * plain <= logs["examples_per_second"] <= 1.5 * plain  # the slow counted step is left out
    assert logs["mfu"] == pytest.approx(logs["examples_per_second"] * meter.flops_per_example / 1e12)
    meter.reset()
    assert meter.summary() == {}  # a new window: nothing timed yet
    with pytest.raises(RuntimeError):  # a step that fails is not counted
        with meter.step((x, y)):
            raise RuntimeError("boom")
    assert meter.summary() == {}


def test_an_unknown_peak_leaves_mfu_out_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(throughput_module, "device_peak", lambda device, precision: None)
    monkeypatch.setattr(throughput_module, "_said_unknown", set())
    x = torch.randn(4, 3)
    model = nn.Linear(3, 2)
    with caplog.at_level(logging.WARNING, logger="towers.diagnostics.throughput"):
        for _ in range(2):
            meter = towers.ThroughputMeter()
            for _ in range(3):
                with meter.step(x):
                    model(x).sum().backward()
            assert set(meter.summary()) == {"examples_per_second"}
    said = [r.getMessage() for r in caplog.records if "MFU is not shown" in r.getMessage()]
    assert len(said) == 1 and "peak_flops=" in said[0]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1e12", True])
def test_a_bad_peak_is_refused_with_the_fix(bad):
    with pytest.raises(ValueError, match=r"peak_flops must be one device's peak in FLOP/s.*Received"):
        towers.ThroughputMeter(peak_flops=bad)


def test_bench_report_shows_tokens_per_second_and_mfu_and_keeps_them_in_json(tmp_path):
    report = BenchReport([Measurement(RAW, 1, "torch (no DDP)", (1000.0, 1200.0, 1100.0)),
                          Measurement("mirrored", 2, "MirroredStrategy", (2000.0,))],
                         model_flops={"flops_per_example": 1e9, "tokens_per_example": 64.0, "peak_flops": 1e13,
                                      "peak_label": "measured CPU float32 matmul peak"})
    raw, mirrored = report.rows()
    assert raw.tokens_per_s == pytest.approx(1100.0 * 64) and raw.mfu == pytest.approx(1100.0 * 1e9 / 1e13)
    assert mirrored.mfu == pytest.approx(2000.0 * 1e9 / (1e13 * 2))  # the peak of both replicas' devices
    table = report.to_table()
    header = table.splitlines()[0].split()
    assert header[-3:] == ["MiB", "tokens/s", "MFU"] and "70,400" in table and "11.0%" in table
    assert "MFU: model FLOPs/s" in table and "measured CPU float32 matmul peak" in table
    again = BenchReport.from_json(report.to_json(tmp_path / "bench.json"))
    assert again.model_flops == report.model_flops and again.rows() == report.rows()
    assert "MFU" not in BenchReport([Measurement(RAW, 1, "torch", (1.0,))]).to_table()  # not measured: no column

