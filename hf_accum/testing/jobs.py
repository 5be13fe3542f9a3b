"""The job table of a torchrun test worker: many checks in ONE launch of 2 processes, one JSON report.

Starting a worker costs more than most of its checks (each process imports torch, transformers, accelerate and
maybe TRL or DeepSpeed: 7-9 CPU-s), so tests/distributed runs one launch per family (loop DDP, Trainer + TRL,
FSDP2, DeepSpeed) and each test reads its job's entry. A worker script is::

    JOBS = {"loop_ddp": loop_ddp, "moe": moe, ...}   # name -> job(out_dir) -> JSON-able result (rank 0's)

    if __name__ == "__main__":
        run_job_table(JOBS, sys.argv[1])
        leave_process_group()  # a no-op after run_job_table: kept where every worker shows it

A job that raises is recorded as ``{"job_error": "<traceback>"}`` and the next job runs: only the tests reading
that job fail (:func:`hf_accum.testing.launch.job_report`). That holds for a failure every rank meets at the same
point (a wrong result, a refused setting); a job that fails on one rank while the other waits in a collective still
stops the launch at its timeout, as a single-purpose worker would. Jobs that leave the process group unusable
(a DDP reducer stopped mid-update) go last in their table.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Mapping

import torch.distributed as dist

from hf_accum.distributed import leave_process_group

JOB_ERROR = "job_error"
Job = Callable[[str], Any]


def run_job_table(jobs: Mapping[str, Job], out_path: str) -> None:
    """Run every job in order, each with its own output folder beside ``out_path``; rank 0 writes
    ``{name: result, ..., "world_size": n}`` to ``out_path``; then the process group is left."""
    out_dir = os.path.dirname(os.path.abspath(out_path))
    report: dict[str, Any] = {}
    for name, job in jobs.items():
        wall, cpu = time.perf_counter(), time.process_time()
        report[name] = _run_one(job, os.path.join(out_dir, name))
        _say(f"job {name}: {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} CPU-s on this rank")
    report["world_size"] = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write(report, out_path)
    leave_process_group()  # its barrier: rank 0's report is on disk before any rank exits


def _say(line: str) -> None:
    """One line on stderr from rank 0 (where a family's time goes, for whoever launches it by hand)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[jobs] {line}", file=sys.stderr, flush=True)


def _run_one(job: Job, out_dir: str) -> Any:
    os.makedirs(out_dir, exist_ok=True)
    try:
        return job(out_dir)
    except Exception:  # noqa: BLE001 -- recorded for the job's own tests; the other jobs still run
        return {JOB_ERROR: traceback.format_exc()[-6000:]}


def _write(report: dict[str, Any], out_path: str) -> None:
    """Whole or not at all: a half-written report must not be read as one."""
    partial = f"{out_path}.partial"
    with open(partial, "w") as handle:
        json.dump(report, handle)
    os.replace(partial, out_path)
