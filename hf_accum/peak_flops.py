"""A device's peak FLOP/s for a compute dtype: the denominator of MFU (:mod:`hf_accum.utilization`).

Where the number comes from, first match wins (:func:`device_peak_flops`):

1. a configured value (``LoopConfig.peak_flops``, ``AccumTrainer(peak_flops=...)``, the recipe's
   ``accumulation.peak_flops``), in FLOP/s per device;
2. the environment variable ``HF_ACCUM_PEAK_FLOPS`` (the same, for a whole process tree: the test suite sets it
   so no test pays for the probe below);
3. CUDA: :data:`GPU_PEAK_TFLOPS`, the vendors' *dense* (no 2:4 sparsity) tensor-core peaks by device name, for
   the dtype (float32 counts as TF32 where ``torch.backends.cuda.matmul.allow_tf32`` lets matmuls use it);
   an unknown name gives no peak (MFU "n/a", and the message names the key to set);
4. CPU: a square GEMM in the dtype, measured once per process (per dtype and thread count) with the run's
   threads, in well under a second (:func:`cpu_gemm_peak`). A GEMM is what the model's matmuls are; no
   published number fits a given CPU, its core count, AVX-512 / AMX, or the cores the run was given.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

PEAK_FLOPS_ENV = "HF_ACCUM_PEAK_FLOPS"

# Dense peak TFLOP/s per GPU (vendor data sheets; the sparse figures are twice these). Keys are matched against
# torch.cuda.get_device_name() in order (the first key contained in the lower-cased name wins, so the more
# specific names come first). Columns: bf16, fp16, tf32, fp32 (non-tensor-core).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "gh200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100 nvl": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "h100 pcie": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM ("NVIDIA H100 80GB HBM3")
    "h800": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "l40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "a10g": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "a6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "v100": {"fp16": 125.0, "fp32": 15.7},
    "t4": {"fp16": 65.0, "fp32": 8.1},
}


@dataclass(frozen=True)
class PeakFlops:
    """A device's peak FLOP/s (None: unknown) for ``dtype``, and where the number came from."""

    flops: float | None
    source: str
    dtype: str = "float32"

    def describe(self) -> str:
        if self.flops is None:
            return f"peak unknown ({self.source})"
        return f"peak {self.flops / 1e9:,.0f} GFLOP/s {self.dtype} ({self.source})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """The dense peak FLOP/s of the GPU called ``device_name`` for ``dtype`` (float32 as TF32 when ``tf32``);
    None when the name or the dtype is not in :data:`GPU_PEAK_TFLOPS`."""
    column = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32" if tf32 else "fp32")
    name = device_name.lower()
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key in name:
            return peaks[column] * 1e12 if column in peaks else None
    return None


@functools.cache
def cpu_gemm_peak(dtype: torch.dtype = torch.float32, threads: int | None = None, budget_s: float = 0.25) -> float:
    """FLOP/s of the best of repeated ``n x n`` GEMMs in ``dtype`` on ``threads`` threads (default: torch's
    current count), measured for about ``budget_s`` seconds after one warm-up; cached per process.

    ``n`` is 512 up to 2 threads, 1024 up to 8, else 2048: measured on 1 thread of this project's Xeon (AVX-512 +
    AMX), 384-512 reach the best float32 rate (160-210 GFLOP/s; 768 and above fell to ~45 with the float32
    kernel torch picks there) and near the best bfloat16 one (1200-1500). The best of the repeats is taken: other
    processes' load only ever slows a repeat down."""
    threads = threads or torch.get_num_threads()
    size = 512 if threads <= 2 else 1024 if threads <= 8 else 2048
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        torch.mm(a, b)  # warm-up: packing buffers, kernel selection
        best = float("inf")
        deadline = time.perf_counter() + budget_s
        while True:
            start = time.perf_counter()
            torch.mm(a, b)
            elapsed = time.perf_counter() - start
            best = min(best, elapsed)
            if start + elapsed >= deadline:
                break
        return 2.0 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def device_peak_flops(device: torch.device | str, dtype: torch.dtype, configured: float | None = None,
                      key: str = "peak_flops") -> PeakFlops:
    """The peak FLOP/s of one ``device`` for ``dtype`` (see the module docstring for the order); ``key`` names
    the setting in the message when a GPU is not in the table."""
    name = dtype_name(dtype)
    if configured is not None:
        return PeakFlops(float(configured), f"configured {key}", name)
    from_env = os.environ.get(PEAK_FLOPS_ENV)
    if from_env:
        return PeakFlops(float(from_env), f"${PEAK_FLOPS_ENV}", name)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(device)
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        peak = gpu_peak_flops(gpu, dtype, tf32)
        if peak is None:
            return PeakFlops(None, f"{gpu!r} not in hf_accum.peak_flops.GPU_PEAK_TFLOPS; set {key}", name)
        return PeakFlops(peak, f"{gpu} dense {'tf32' if tf32 else name} data-sheet peak", name)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return PeakFlops(cpu_gemm_peak(dtype, threads), f"GEMM measured on {threads} thread(s)", name)
    return PeakFlops(None, f"no peak known for device type {device.type!r}; set {key}", name)


def check_peak_flops(value: object, key: str) -> str | None:
    """Why ``value`` cannot be a configured peak (None: it can): a number > 0 (FLOP/s per device) or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        return f"{key}={value!r} must be None or a number of FLOP/s per device > 0 (e.g. 989e12)"
    return None
