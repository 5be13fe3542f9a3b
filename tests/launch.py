"""Launch a test worker on 2 real CPU processes.

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

HERE = os.path.dirname(__file__)


def run_torchrun(worker: str, out_path, nproc: int = 2, timeout: int = 300) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               os.path.join(HERE, worker), str(out_path)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out_path) as handle:
        return json.load(handle)
