"""Launch a worker script on 2 real CPU processes (gloo) and read back its JSON report.

torchrun, not ``accelerate launch --cpu --num_processes 2`` (which silently starts ONE process);
``--standalone`` picks a free rendezvous port (``--master_port 0`` would hand port 0 itself to the
workers, whose rendezvous then hangs). Workers write a JSON report that includes the world size
they really got, which the tests assert.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Sequence


def run_torchrun(worker: str, out_path, nproc: int = 2, timeout: int = 300, extra_args: Sequence[str] = ()) -> dict:
    """Run ``worker OUT.json [extra_args]`` under torchrun; return the JSON it wrote (rank 0)."""
    completed = torchrun(worker, [str(out_path), *extra_args], nproc, timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out_path) as handle:
        return json.load(handle)


def torchrun(worker: str, args: Sequence[str], nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``worker *args`` under torchrun and return the finished process, whatever its exit code (for
    workers that are killed or stop on purpose)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               worker, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
