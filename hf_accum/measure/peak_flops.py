"""A device's peak FLOP/s for a compute dtype: the denominator of MFU (:mod:`hf_accum.measure.utilization`), and
whether a half-precision dtype pays on this CPU at all (:func:`half_precision_slowdown`).

Where the peak comes from, first match wins (:func:`device_peak_flops`); its ``source`` always says which:

1. a configured value (``LoopConfig.peak_flops``, ``AccumTrainer(peak_flops=...)``, the recipe's
   ``accumulation.peak_flops``), in FLOP/s per device ("configured ...");
2. the environment variable ``HF_ACCUM_PEAK_FLOPS`` (the same, for a whole process tree: the test suite sets it
   so no test pays for the probe below);
3. CUDA: :data:`GPU_PEAK_TFLOPS`, the vendors' *dense* (no 2:4 sparsity) tensor-core peaks by device name, for
   the dtype (float32 counts as TF32 where ``torch.backends.cuda.matmul.allow_tf32`` lets matmuls use it)
   ("... (table)"); an unknown name gives no peak (MFU "n/a", and the message names the key to set);
4. CPU: one core's square-GEMM rate in the dtype times the physical cores the run's threads occupy
   (:func:`cpu_gemm_rate`): no published number fits a given CPU, its core count, AVX-512 / AMX, or the cores
   the run was given. A peak is a property of the hardware, not of the moment, so (a) one core's rate is the
   *best* of several short probes on one thread, each after a short sleep (the scheduler favours a task that
   just woke, so a probe starts on a core of its own even beside a CPU-burning process; a probe that loses its
   core only lowers itself, and a multi-threaded GEMM would wait for its slowest thread: see
   :func:`core_gemm_rate`), and (b) it is measured once per machine and cached ("measured 2026-11-28, best of 5
   probes on 1 thread", later "cached in ...: measured ...") in ``$HF_ACCUM_CACHE/peak_flops.json`` (default
   ``$XDG_CACHE_HOME/hf_accum``, else ``~/.cache/hf_accum``), keyed by the CPU (model name, family / model /
   stepping, a hash of its feature flags), the dtype and torch's version (its kernels are what is measured). A
   different CPU is a different key: measured afresh. Each later start probes once more (0.05 s) and raises the
   cached rate when it beats it, so a first measurement on a busy machine heals; delete the file to measure
   from scratch. A cache that cannot be read or written (read-only home) never stops a run: the rate is
   measured in the process and a warning says so once.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeGuard

import torch

logger = logging.getLogger(__name__)

PEAK_FLOPS_ENV = "HF_ACCUM_PEAK_FLOPS"
CACHE_ENV = "HF_ACCUM_CACHE"
"""A folder for hf_accum's per-machine cache (``peak_flops.json``)."""
CACHE_FILE = "peak_flops.json"
PROBES = 5
"""Probes per measurement; the best one is the rate."""
TOP_UP_PROBE_S = 0.05
"""A cached rate's check at each start (one probe; see :func:`_cached_rate`)."""
PROBE_NAP_S = 0.01
"""The sleep before each probe (see the module docstring)."""
_GEMM_TARGET_S = 0.05
"""A probe's GEMM size: the largest (up to :func:`_largest_size`) whose one GEMM takes at most this long, so a
dtype without fast kernels (bf16 at ~0.5 GFLOP/s) is probed with small GEMMs in the same short time."""

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


@dataclass(frozen=True)
class GemmRate:
    """A CPU's best GEMM rate for one dtype and thread count, and where it came from (measured / cached)."""

    flops: float
    source: str


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


# -- the CPU probe ---------------------------------------------------------------------------------------------


def cpu_gemm_peak(dtype: torch.dtype = torch.float32, threads: int | None = None, budget_s: float = 0.5,
                  probes: int = PROBES) -> float:
    """FLOP/s of ``dtype`` square GEMMs on ``threads`` threads (default: torch's current count): the best of
    ``probes`` probes of about ``budget_s / probes`` seconds each, every probe after a short sleep, every probe
    the fastest of its repeats. Other processes' load only ever slows a GEMM down, so the best is the hardware's.

    The size grows from 128 while one GEMM stays under :data:`_GEMM_TARGET_S`, up to 512 (up to 2 threads), 1024
    (up to 8) or 2048: on 1 thread of a Xeon (AVX-512 + AMX) 384-512 reached the best float32 rate (160-210
    GFLOP/s; 768 and above fell to ~45 with the kernel torch picks there) and near the best bfloat16 one
    (1200-1500); on this project's AMD EPYC (Zen 4), 512 reads 103 GFLOP/s float32 and 225 bfloat16 on 1 thread."""
    threads = threads or torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    # One thread: the GEMM runs in this thread, so its CPU time is the time it computed; time a neighbour's
    # process took the core from it is not counted (wall time on a shared 2-core machine read 55 GFLOP/s where
    # the core does 96). Several threads: wall time (the other threads' CPU time is not this thread's).
    clock = time.thread_time if threads == 1 else time.perf_counter
    try:
        a, b = _probe_matrices(dtype, _largest_size(threads), clock)
        return max(_probe(a, b, budget_s / probes, clock) for _ in range(probes))
    finally:
        torch.set_num_threads(previous)


def _largest_size(threads: int) -> int:
    return 512 if threads <= 2 else 1024 if threads <= 8 else 2048


def _probe_matrices(dtype: torch.dtype, largest: int,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[torch.Tensor, torch.Tensor]:
    """Two square matrices of the largest size (a power of two from 128 to ``largest``) whose GEMM, at the rate
    the previous size showed (the best of 3), takes at most :data:`_GEMM_TARGET_S`."""
    size = 128
    while True:
        generator = torch.Generator().manual_seed(size)
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        torch.mm(a, b)  # warm-up: packing buffers, kernel selection
        rate = max(_gemm_rate(a, b, clock) for _ in range(3))
        if size >= largest or 2.0 * (2 * size) ** 3 / rate > _GEMM_TARGET_S:
            return a, b
        size *= 2


def _gemm_rate(a: torch.Tensor, b: torch.Tensor, clock: Callable[[], float] = time.perf_counter) -> float:
    """FLOP/s of one ``a @ b``, timed by ``clock``."""
    start = clock()
    torch.mm(a, b)
    return 2.0 * a.shape[0] ** 3 / max(clock() - start, 1e-9)


def _probe(a: torch.Tensor, b: torch.Tensor, seconds: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of repeated ``a @ b`` (each timed by ``clock``) for about ``seconds`` of wall time, as FLOP/s,
    after a short sleep."""
    time.sleep(PROBE_NAP_S)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        start = clock()
        torch.mm(a, b)
        best = min(best, clock() - start)
        if time.perf_counter() >= deadline:
            break
    return 2.0 * a.shape[0] ** 3 / max(best, 1e-9)


# -- the per-machine cache -------------------------------------------------------------------------------------

_rates: dict[str, GemmRate] = {}
"""This process's rates by cache key (measured or read once per process)."""
_said_cache_problem = False


def cache_path() -> Path:
    """``$HF_ACCUM_CACHE/peak_flops.json``, else under ``$XDG_CACHE_HOME/hf_accum`` or ``~/.cache/hf_accum``."""
    folder = os.environ.get(CACHE_ENV)
    if folder:
        return Path(folder).expanduser() / CACHE_FILE
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "hf_accum" / CACHE_FILE


def cpu_identity() -> str:
    """The CPU as the cache knows it: model name, family / model / stepping, a hash of its feature flags."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    detail = " ".join(f"{k.replace('cpu ', '')} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info)
    flags = " ".join(sorted((info.get("flags") or info.get("Features") or "").split()))
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{name}{f' ({detail})' if detail else ''}, flags {digest}"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none: macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def rate_key(dtype: torch.dtype) -> str:
    """The cache's key of one core's rate for ``dtype`` (see the module docstring)."""
    return f"{cpu_identity()} | 1 thread | {dtype_name(dtype)} | torch {torch.__version__}"


def cpu_gemm_rate(dtype: torch.dtype = torch.float32, threads: int | None = None) -> GemmRate:
    """This CPU's GEMM rate for ``dtype`` on ``threads`` threads (default: torch's count): one core's rate
    (:func:`core_gemm_rate`) times the physical cores those threads can occupy (:func:`cores_for`)."""
    core = core_gemm_rate(dtype)
    cores = cores_for(threads or torch.get_num_threads())
    return GemmRate(core.flops * cores, f"{cores} core(s) x one core's GEMM, {core.source}")


def cores_for(threads: int) -> int:
    """The physical cores ``threads`` threads of this process can run on: at most the cores of the CPUs it may use
    (hyperthread siblings share one core's vector units, so they add no peak), and, when the processes of a
    multi-process run on this machine (``LOCAL_WORLD_SIZE``) are not pinned to CPUs of their own, its share of them
    (the peak is multiplied by the processes: each may claim only its share)."""
    info = _cpuinfo()
    siblings, cores = info.get("siblings", ""), info.get("cpu cores", "")
    per_core = int(siblings) // int(cores) if siblings.isdigit() and cores.isdigit() and int(cores) else 1
    every = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else every
    physical = max(1, usable // max(1, per_core))
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if usable >= every and local.isdigit() and int(local) > 1:
        physical = max(1, physical // int(local))
    return max(1, min(threads, physical))


def core_gemm_rate(dtype: torch.dtype = torch.float32) -> GemmRate:
    """One core's GEMM rate for ``dtype``: from this process, else the per-machine cache, else measured on one
    thread (:func:`cpu_gemm_peak`) and cached. Never raises for the cache's sake.

    One thread, not the run's: a multi-threaded GEMM is as slow as its most delayed thread, so beside other
    processes every probe waits for a time slice (measured here: 2 threads on this busy 2-core machine read 0.1
    GFLOP/s at n=128, idle 200), while one thread finds a free core. A GEMM large enough to be compute-bound
    scales with the cores (here: 2 threads 200-207 GFLOP/s float32 = 2.0x one thread's 103; 442 bfloat16 = 2.0x
    225); on CPUs whose all-core clock is below their one-core clock the product reads a little high (MFU low)."""
    key = rate_key(dtype)
    if key in _rates:
        return _rates[key]
    entry = _read_cache().get(key)
    if _valid(entry):
        rate = _cached_rate(key, entry, dtype)
    else:
        flops, today = cpu_gemm_peak(dtype, 1), datetime.date.today().isoformat()
        _write_cache(key, {"flops": flops, "measured": today, "probes": PROBES})
        rate = GemmRate(flops, f"measured {today}, best of {PROBES} probes on 1 thread")
    _rates[key] = rate
    return rate


def _cached_rate(key: str, entry: dict[str, Any], dtype: torch.dtype) -> GemmRate:
    """The cached rate, raised (and re-cached) when one quick probe now beats it by more than 5%: a first
    measurement on a busy machine heals in later runs instead of lowering every MFU denominator for good."""
    now = cpu_gemm_peak(dtype, 1, budget_s=TOP_UP_PROBE_S, probes=1)
    if now > 1.05 * entry["flops"]:
        entry = {"flops": now, "measured": datetime.date.today().isoformat(), "probes": entry["probes"] + 1}
        _write_cache(key, entry)
    return GemmRate(float(entry["flops"]), f"cached in {cache_path()}: measured {entry['measured']}, best of "
                                           f"{entry['probes']} probes on 1 thread")


def _valid(entry: Any) -> TypeGuard[dict[str, Any]]:
    if not isinstance(entry, dict):
        return False
    flops = entry.get("flops")
    return (isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0
            and isinstance(entry.get("measured"), str) and isinstance(entry.get("probes"), int))


def _read_cache() -> dict[str, Any]:
    """The cache's entries ({} when it is missing, unreadable or not ours: then it is measured again)."""
    try:
        data = json.loads(cache_path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        _say_cache_problem(f"not read ({type(error).__name__}: {error})")
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    """Add ``entry`` atomically (a temporary file renamed over the cache); on any error say so once and go on."""
    path = cache_path()
    try:
        entries = _read_cache()
        entries[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".peak_flops.", suffix=".tmp",
                                         delete=False) as handle:
            json.dump({"version": 1, "entries": entries}, handle, indent=1, sort_keys=True)
        os.replace(handle.name, path)
    except Exception as error:  # a cache is an optimisation: nothing about it may stop a run
        _say_cache_problem(f"not written ({type(error).__name__}: {error})")


def _say_cache_problem(what: str) -> None:
    global _said_cache_problem
    if not _said_cache_problem:
        _said_cache_problem = True
        logger.warning("peak FLOP/s cache %s %s: the CPU's GEMM rate is measured in this process instead "
                       "(set $%s to a writable folder to keep it)", cache_path(), what, CACHE_ENV)


# -- the peak and the half-precision check ---------------------------------------------------------------------


def device_peak_flops(device: torch.device | str, dtype: torch.dtype, configured: float | None = None,
                      key: str = "peak_flops") -> PeakFlops:
    """The peak FLOP/s of one ``device`` for ``dtype`` (see the module docstring for the order); ``key`` names
    the setting in the message when a GPU is not in the table."""
    name = dtype_name(dtype)
    if configured is not None:
        return PeakFlops(float(configured), f"configured {key}", name)
    from_env = os.environ.get(PEAK_FLOPS_ENV)
    if from_env:
        return PeakFlops(float(from_env), f"configured by ${PEAK_FLOPS_ENV}", name)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(device)
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        peak = gpu_peak_flops(gpu, dtype, tf32)
        if peak is None:
            return PeakFlops(None, f"{gpu!r} not in hf_accum.measure.peak_flops.GPU_PEAK_TFLOPS; set {key}", name)
        return PeakFlops(peak, f"{gpu} dense {'tf32' if tf32 else name} data-sheet peak (table)", name)
    if device.type == "cpu":
        rate = cpu_gemm_rate(dtype)
        return PeakFlops(rate.flops, rate.source, name)
    return PeakFlops(None, f"no peak known for device type {device.type!r}; set {key}", name)


def half_precision_slowdown(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why ``dtype`` (bfloat16 / float16) compute does not pay on ``device``: its GEMMs are slower than float32's
    there (None: they are not, or the device is not a CPU). From the same cached probes as the CPU peak."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    half, full = core_gemm_rate(dtype), core_gemm_rate(torch.float32)
    if half.flops >= full.flops:
        return None
    return (f"{dtype_name(dtype)} GEMMs on this CPU run at {half.flops / full.flops:.2g}x float32 "
            f"({half.flops / 1e9:,.1f} vs {full.flops / 1e9:,.1f} GFLOP/s per core; {half.source}): float32 "
            f"compute would be ~{full.flops / half.flops:,.0f}x faster on the matmuls")

