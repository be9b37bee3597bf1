"""A device's peak FLOP/s: vendor datasheet figures for common GPUs, a measured matmul peak on the CPU.

The table holds dense figures (no structured sparsity): datasheets print the sparse figure for the
tensor cores with an asterisk, and it is twice the dense one. The precision a strategy computes in
picks the column: ``"bf16"`` and ``"fp16"`` their tensor-core rates; ``"32"`` TF32 where torch's
float32 matmuls may use it (``torch.get_float32_matmul_precision()`` other than ``"highest"``) and the
GPU has it, plain FP32 otherwise. A GPU that is not in the table has no peak: MFU is not shown then.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Mapping

import torch

__all__ = ["PeakFlops", "GPU_PEAK_TFLOPS", "gpu_peak", "measured_cpu_peak", "device_peak", "compute_dtype"]


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak, in FLOP/s, and where the figure comes from (shown beside the MFU)."""

    flops_per_second: float
    label: str
    measured: bool = False


# Dense TFLOP/s by compute dtype, from each vendor's datasheet (sparse figures halved):
#   H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet: FP32 67 / 51 / 60; TF32 989* / 756* / 835*;
#     BF16 and FP16 1,979* / 1,513* / 1,671* (* with sparsity).
#   H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet: FP32 67 / 60; TF32 989* / 835*; BF16, FP16 1,979* / 1,671*.
#   A100 (SXM and PCIe, 40 and 80 GB): NVIDIA A100 datasheet: FP32 19.5; TF32 156; BF16, FP16 312.
#   L4: NVIDIA L4 datasheet: FP32 30.3; TF32 120*; BF16, FP16 242*.
#   L40S: NVIDIA L40S datasheet: FP32 91.6; TF32 183; BF16, FP16 362.05.
#   A10: NVIDIA A10 datasheet: FP32 31.2; TF32 62.5; BF16, FP16 125. NVIDIA publishes no A10G datasheet; AWS
#     describes the A10G as an A10-class GPU, so it takes the A10's figures.
#   V100 SXM2 / PCIe / V100S: NVIDIA V100 datasheet: FP32 15.7 / 14 / 16.4; tensor (FP16) 125 / 112 / 130.
#     No TF32 (float32 matmuls run at the FP32 rate) and no BF16 tensor cores.
#   T4: NVIDIA T4 datasheet: FP32 8.1; FP16 65. No TF32, no BF16.
#   MI300X: AMD Instinct MI300X datasheet: FP32 (matrix) 163.4; TF32 653.7; BF16, FP16 1,307.4.
GPU_PEAK_TFLOPS: Mapping[str, Mapping[str, float]] = {
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
    "A10G": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "V100 SXM2": {"fp32": 15.7, "fp16": 125.0},
    "V100 PCIe": {"fp32": 14.0, "fp16": 112.0},
    "V100S PCIe": {"fp32": 16.4, "fp16": 130.0},
    "T4": {"fp32": 8.1, "fp16": 65.0},
    "MI300X": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
}

# torch.cuda.get_device_name() -> table row, first match wins ("NVIDIA H100 80GB HBM3" is the SXM part,
# "NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-32GB", "AMD Instinct MI300X", ...).
_NAMES: tuple[tuple[str, str], ...] = (
    (r"H100.*PCIE", "H100 PCIe"), (r"H100.*NVL", "H100 NVL"), (r"H100", "H100 SXM"),
    (r"H200.*NVL", "H200 NVL"), (r"H200", "H200 SXM"), (r"A100", "A100"), (r"L40S", "L40S"), (r"\bL4\b", "L4"),
    (r"A10G", "A10G"), (r"\bA10\b", "A10"), (r"V100S", "V100S PCIe"), (r"V100.*PCIE", "V100 PCIe"),
    (r"V100", "V100 SXM2"), (r"\bT4\b", "T4"), (r"MI300X", "MI300X"),
)

_PRECISION_DTYPES = {"bf16": "bf16", "fp16": "fp16"}


def compute_dtype(precision: str, device: torch.device) -> str:
    """Return the dtype whose peak applies: ``"bf16"``/``"fp16"`` for those precisions, ``"tf32"`` or ``"fp32"`` for ``"32"``."""
    if precision in _PRECISION_DTYPES:
        return _PRECISION_DTYPES[precision]
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def gpu_peak(device_name: str, dtype: str) -> PeakFlops | None:
    """Return the datasheet peak of the GPU called ``device_name`` in ``dtype`` (dense), or None when unknown."""
    upper = device_name.upper()
    key = next((key for pattern, key in _NAMES if re.search(pattern, upper)), None)
    if key is None:
        return None
    row = GPU_PEAK_TFLOPS[key]
    if dtype == "tf32" and "tf32" not in row:
        dtype = "fp32"  # no TF32 on this GPU: torch's float32 matmuls run at the FP32 rate
    if dtype not in row:
        return None
    return PeakFlops(row[dtype] * 1e12, f"{key} {dtype} dense peak {row[dtype]:g} TFLOP/s (datasheet)")


_measured: dict[int, PeakFlops] = {}


def measured_cpu_peak(*, size: int = 1024, repeats: int = 3) -> PeakFlops:
    """Return this process's CPU float32 matmul peak: the best of ``repeats`` timed ``size`` x ``size`` matmuls.

    Measured once per process and thread count (about 0.1 s), with the threads torch uses now.
    """
    threads = torch.get_num_threads()
    if threads not in _measured:
        # A generator of its own: the user's random stream (dropout, shuffling, a resumed run's) must not move.
        g = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, device="cpu", generator=g)
        b = torch.randn(size, size, device="cpu", generator=g)
        a @ b  # warm-up: the first call pays for thread start-up and packing buffers
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        flops = 2.0 * size ** 3 / max(best, 1e-9)
        _measured[threads] = PeakFlops(flops, f"measured CPU float32 matmul peak {flops / 1e9:,.0f} GFLOP/s "
                                              f"({threads} thread(s))", measured=True)
    return _measured[threads]


def device_peak(device: torch.device | str, precision: str = "32") -> PeakFlops | None:
    """Return the peak of one ``device`` computing in ``precision`` (``"32"``, ``"bf16"``, ``"fp16"``), or None.

    A GPU's comes from ``GPU_PEAK_TFLOPS`` (None when its name is not there); the CPU's is measured.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return measured_cpu_peak()
    if device.type != "cuda":
        return None
    return gpu_peak(torch.cuda.get_device_name(device), compute_dtype(precision, device))
