"""The peak memory of a whole run, as ``metrics.json`` and the run's end line report it.

* CUDA: ``torch.cuda.max_memory_allocated`` (the caching allocator's peak of live tensor bytes, the number to
  compare with a GPU's memory) and ``max_memory_reserved`` (what the allocator held from the driver), on this
  process's device, since the process started (or the last ``torch.cuda.reset_peak_memory_stats``).
* CPU: the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``): what the machine had
  to give this process, weights, activations, Python, libraries and allocator slack included -- the number a
  memory limit (a container, ``ulimit``, the OOM killer) acts on. The allocator-level peak of live tensor bytes
  (what ``hf_accum.measure.memory.measure_memory`` and the benchmarks read) needs the profiler's memory events, which
  cost too much over a whole run; ``hf-accum bench`` measures it on a window instead.

Each rank reports its own; the recipe reports the largest over the ranks.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size: Linux's ``VmHWM`` (the high-water mark of this program's own memory
    since it started), else ``ru_maxrss`` (KiB on Linux, bytes on macOS). Not ``ru_maxrss`` on Linux: it carries
    the peak of the process that forked this one across ``exec``, so a run started from a large parent (a test
    runner, a notebook) would report the parent's peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_memory(device: torch.device | str | None = None) -> dict[str, Any]:
    """``{"peak_rss_bytes", ...}`` of this process, plus ``peak_allocated_bytes`` / ``peak_reserved_bytes`` on a
    CUDA ``device``."""
    reading: dict[str, Any] = {"peak_rss_bytes": peak_rss_bytes()}
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        reading["device"] = str(device)
        reading["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        reading["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
    return reading


def largest_over_ranks(reading: dict[str, Any]) -> dict[str, Any]:
    """Each byte count's maximum over all ranks (a collective when torch.distributed is initialized: every
    rank must call it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(reading)
    keys = sorted(k for k, v in reading.items() if k.endswith("_bytes"))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    values = torch.tensor([float(reading[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {**reading, **{k: int(v) for k, v in zip(keys, values.tolist())}}


def describe(reading: dict[str, Any]) -> str:
    """``peak memory 1.52 GiB RSS`` (+ ``, 0.80 GiB allocated on cuda:0``): the end line's words."""
    gib = 2**30
    text = f"peak memory {reading['peak_rss_bytes'] / gib:.2f} GiB RSS"
    if "peak_allocated_bytes" in reading:
        text += f", {reading['peak_allocated_bytes'] / gib:.2f} GiB allocated on {reading.get('device', 'cuda')}"
    return text
