"""One process per measured run, and the peak-memory counters those runs read.

A peak memory is only a run's own when nothing ran before it in the same process: the allocator keeps
freed blocks, thread pools and lazily built kernels stay, and the peak resident size never goes down.
:class:`Workers` therefore runs each measurement in a fresh process. One helper process
(``python -m benchmarks.workers MODULE ...``) imports torch, transformers, hf_accum and the sections'
modules once (about 12 CPU seconds) and forks a child per run; the helper itself never computes, so
each child starts clean: no allocator cache, no thread pool, no CUDA context of an earlier run.

Protocol: one JSON line ``{"call": "module:function", "spec": {...}, "out": path}`` in, one line
``ok`` / ``failed`` out; the child calls ``function(**spec)``, writes what it returns (a dataclass or a
dict) as JSON to ``out``, and its own output to the helper's stderr (kept for the error message).

A bench killed from outside (``kill``, a CI timeout; Ctrl-C reaches the whole process group anyway) takes its
helper and the helper's child with it (:func:`die_with_parent`): a run of minutes is not left computing alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch

from hf_accum.startup import keep_bitsandbytes_out

PARENT_PID = "HF_ACCUM_BENCH_PARENT_PID"


def checkout_root() -> Path:
    """The repository checkout this benchmarks package lives in (the helper imports it from there)."""
    return Path(__file__).resolve().parent.parent


class Workers:
    """Runs ``module:function(**spec)`` calls, each in a fresh process forked from one warm helper."""

    def __init__(self, threads: int | None, preload: Sequence[str] = (), env: dict[str, str] | None = None):
        """``env``: variables added to the helper's environment (read by torch at start-up, e.g.
        ``THP_MEM_ALLOC_ENABLE``), so every run forked from it has them."""
        path = [str(checkout_root()), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(path))
        env[PARENT_PID] = str(os.getpid())  # the helper dies with this process (die_with_parent)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self._dir = tempfile.TemporaryDirectory(prefix="hf_accum_bench_")
        self._log = open(Path(self._dir.name) / "workers.log", "w+")
        self._helper = subprocess.Popen([sys.executable, "-m", "benchmarks.workers", *preload], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, env=env, text=True)

    def call(self, target: str, spec: Any, what: str) -> dict:
        """``target(**spec)`` (``spec``: a dataclass or a dict) in a fresh child; its result as a dict.
        ``what`` names the run in the error raised when the child fails (with the end of its output)."""
        out = Path(self._dir.name) / "run.json"
        out.unlink(missing_ok=True)
        values = dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else dict(spec)
        self._helper.stdin.write(json.dumps({"call": target, "spec": values, "out": str(out)}) + "\n")
        self._helper.stdin.flush()
        if self._helper.stdout.readline().strip() != "ok":
            self._log.seek(0)
            raise RuntimeError(f"{what} failed:\n{self._log.read()[-4000:]}")
        return json.loads(out.read_text())

    def close(self) -> None:
        self._helper.stdin.close()
        self._helper.wait()
        self._log.close()
        self._dir.cleanup()


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def die_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``), and
    exit at once if ``parent`` (its pid, known to the caller) already exited, i.e. this process was re-parented
    before the request was in place. Elsewhere nothing: the helper still ends when its stdin closes, after the run
    in progress. (Comparing with the expected pid, not with 1: a bench may itself be pid 1, in a container.)"""
    with contextlib.suppress(OSError, AttributeError):  # not Linux/glibc
        PR_SET_PDEATHSIG = 1
        if ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            return
    if os.getppid() != parent:
        os._exit(1)


def serve() -> None:
    """The helper's loop (see :class:`Workers`): fork a child per request, answer when it is done."""
    die_with_parent(int(os.environ.get(PARENT_PID, os.getppid())))  # the bench's process
    for line in sys.stdin:
        request = json.loads(line)
        helper = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: run, write the result, exit without running the helper's cleanup
            die_with_parent(helper)  # the signal is sent on the parent's death; fork does not inherit the request
            status = 1
            try:
                os.dup2(2, 1)  # library prints go to the log, not into the protocol
                result = _resolve(request["call"])(**request["spec"])
                if dataclasses.is_dataclass(result):
                    result = dataclasses.asdict(result)
                Path(request["out"]).write_text(json.dumps(result))
                status = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        print("ok" if os.waitstatus_to_exitcode(wait_status) == 0 else "failed", flush=True)


# ----------------------------------------------------------------------------------------------
# Peak memory of the run in this process
# ----------------------------------------------------------------------------------------------


def reset_peak(device: torch.device) -> int:
    """Restart the device's peak-memory counter; return the memory in use now (CPU: resident bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    release_free_heap()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
    return proc_status_bytes("VmRSS")


def release_free_heap() -> None:
    """Hand the heap's free memory back to the OS before the baseline is read. Without it, memory that setup
    freed (tokenizing, TRL's packing, model construction) stays resident, counts in the baseline, and is
    then reused by training without raising the RSS: the measured increment shrank by whatever setup happened
    to leave behind."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory(device: torch.device) -> int:
    """The peak since :func:`reset_peak` (CPU: peak resident bytes, ``VmHWM``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return proc_status_bytes("VmHWM")


def proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {key}")


if __name__ == "__main__":  # the helper process of Workers: preload the modules named, then serve
    # No run of a section quantizes: without bitsandbytes' import (PEFT's, through transformers' Trainer, TRL and
    # PEFT) the helper starts ~1.5 CPU-s sooner (hf_accum.startup); only torch is imported yet.
    keep_bitsandbytes_out()
    for name in sys.argv[1:]:
        importlib.import_module(name)
    # What the helper imported stays for every child: out of the collector's sight, a child's gc.collect() (the
    # peak reset's, accelerate's free_memory) no longer walks the preloaded modules' objects (~0.25 s a call with
    # transformers, TRL and PEFT loaded), and the pages stay shared with the helper instead of being written to.
    gc.freeze()
    serve()
