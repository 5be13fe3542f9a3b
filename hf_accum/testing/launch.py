"""Launch a worker script on 2 real CPU processes (gloo), or on 2 "nodes" of this host, and read back its
JSON report.

torchrun, not ``accelerate launch --cpu --num_processes 2`` (which silently starts ONE process);
``--standalone`` picks a free rendezvous port (``--master_port 0`` would hand port 0 itself to the
workers, whose rendezvous then hangs). Workers write a JSON report that includes the world size
they really got, which the tests assert.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Sequence


def run_torchrun(worker: str, out_path, nproc: int = 2, timeout: int = 300, extra_args: Sequence[str] = ()) -> dict:
    """Run ``worker OUT.json [extra_args]`` under torchrun; return the JSON it wrote (rank 0)."""
    completed = torchrun(worker, [str(out_path), *extra_args], nproc, timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out_path) as handle:
        return json.load(handle)


def run_torchrun_nodes(
    worker: str, out_path, nodes: int = 2, timeout: int = 300, extra_args: Sequence[str] = ()
) -> dict:
    """Run ``worker OUT.json`` as ``nodes`` torchrun "nodes" of 1 process each on this host (c10d rendezvous
    on a free local port), as a multi-node job starts; return the JSON the global rank 0 wrote."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    endpoint = f"localhost:{_free_port()}"
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", "1",
         "--node_rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "hf_accum_test",
         worker, str(out_path), *extra_args]
        for rank in range(nodes)
    ]
    agents = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-4000:]
    with open(out_path) as handle:
        return json.load(handle)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def torchrun(worker: str, args: Sequence[str], nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``worker *args`` under torchrun and return the finished process, whatever its exit code (for
    workers that are killed or stop on purpose)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               worker, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
