"""Launch a worker script on 2 real CPU processes (gloo), or on 2 "nodes" of this host, and read back its
JSON report; a worker running a job table (:mod:`hf_accum.testing.jobs`) holds many checks, each test reading
its job's entry with :func:`job_report`.

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
import time
import warnings
from typing import Any, Iterator, Mapping, Sequence

from hf_accum.testing.jobs import JOB_ERROR

# What a gloo process prints when it aborts at interpreter exit with its process group still up (see
# hf_accum.distributed.leave_process_group, which every worker calls to prevent it).
EXIT_ABORT_SIGNATURE = "terminate called without an active exception"


def run_torchrun(worker: str, out_path: str | os.PathLike[str], nproc: int = 2, timeout: int = 300,
                 extra_args: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``worker OUT.json [extra_args]`` under torchrun; return the JSON it wrote (rank 0).

    A job that wrote its report and then failed with the gloo abort at exit is run once more, with a warning
    carrying the first output: the abort comes after the worker's last collective, so it says nothing about
    the result, but torchrun then kills the other rank. Any other failure -- a worker that raised exits with
    its group up and may print the same abort after its traceback, but writes no report -- fails at once."""
    if os.path.exists(out_path):
        os.remove(out_path)  # a report left by an earlier run must not pass for this one's
    completed = torchrun(worker, [str(out_path), *extra_args], nproc, timeout)
    if completed.returncode != 0 and EXIT_ABORT_SIGNATURE in completed.stderr and os.path.exists(out_path):
        warnings.warn(f"torchrun job retried after a rank aborted at exit:\n{completed.stderr[-3000:]}", stacklevel=2)
        completed = torchrun(worker, [str(out_path), *extra_args], nproc, timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out_path) as handle:
        return json.load(handle)


def job_report(family: dict[str, Any], name: str) -> Any:
    """Job ``name``'s entry of a job-table report (:mod:`hf_accum.testing.jobs`), with the launch's
    ``world_size``; fails with the job's traceback when the job raised in the worker."""
    if name not in family:
        raise AssertionError(f"job {name!r} is not in the report (jobs: {sorted(family)})")
    entry = family[name]
    if name == "world_size":
        return entry
    if isinstance(entry, dict) and JOB_ERROR in entry:
        raise AssertionError(f"job {name!r} raised in the worker:\n{entry[JOB_ERROR]}")
    return {**entry, "world_size": family["world_size"]} if isinstance(entry, dict) else entry


class JobReports(Mapping[str, Any]):
    """A job-table report read job by job: ``reports[name]`` is :func:`job_report` of that job, so a job that
    raised fails only the tests reading it."""

    def __init__(self, family: dict[str, Any]) -> None:
        self.family = family

    def __getitem__(self, name: str) -> Any:
        return job_report(self.family, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.family)

    def __len__(self) -> int:
        return len(self.family)


def run_torchrun_nodes(
    worker: str, out_path: str | os.PathLike[str], nodes: int = 2, timeout: int = 300, extra_args: Sequence[str] = (),
    attempts: int = 2,
) -> dict[str, Any]:
    """Run ``worker OUT.json`` as ``nodes`` torchrun "nodes" of 1 process each on this host (c10d rendezvous
    on a free local port), as a multi-node job starts; return the JSON the global rank 0 wrote.

    Why it is built this way (it once hung in CI while passing everywhere else):
    - each agent's output goes to a file, not a pipe: with pipes read one agent after the other, a node
      whose pipe filled blocked in ``write`` while the other waited for it in torchrun's exit barrier;
    - node 0 hosts the rendezvous store (``is_host``), stated rather than raced for, and starts first;
    - a fresh rendezvous id and port per attempt; a job whose rendezvous never completed within the time
      (no report written) is started once more on a new port, the first attempt's logs kept in the error.
    """
    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        outcome = _run_nodes_once(worker, out_path, nodes, timeout, extra_args, attempt)
        if outcome is None:
            with open(out_path) as handle:
                return json.load(handle)
        failures.append(f"attempt {attempt}: {outcome}")
        if os.path.exists(out_path):
            break  # the job ran and failed: running it again would not say anything new
    raise AssertionError("\n\n".join(failures))


def _run_nodes_once(worker: str, out_path: str | os.PathLike[str], nodes: int, timeout: int, extra_args: Sequence[str],
                    attempt: int) -> str | None:
    """One try of :func:`run_torchrun_nodes`; None when every agent exited 0 and the report exists, else
    what went wrong with each agent's log tail."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    endpoint = f"localhost:{_free_port()}"
    run_id = f"hf_accum_test_{os.getpid()}_{attempt}_{time.monotonic_ns()}"
    log_dir = os.path.join(os.path.dirname(os.path.abspath(out_path)), f"agents-{attempt}")
    os.makedirs(log_dir, exist_ok=True)
    agents, logs = [], []
    deadline = time.monotonic() + timeout
    try:
        for rank in range(nodes):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", "1",
                "--node_rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", run_id, "--rdzv-conf", f"is_host={1 if rank == 0 else 0}",
                worker, str(out_path), *extra_args,
            ]
            log = open(os.path.join(log_dir, f"node{rank}.log"), "w")
            logs.append(log)
            agents.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
        timed_out = _wait_all(agents, deadline)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        for log in logs:
            log.close()
    problems = [f"node {rank} exit {agent.returncode}" for rank, agent in enumerate(agents) if agent.returncode != 0]
    if not timed_out and not problems and os.path.exists(out_path):
        return None
    what = f"timed out after {timeout} s" if timed_out else ", ".join(problems) or "no report written"
    tails = "\n".join(f"--- node {rank} ({path}) ---\n{_tail(path)}"
                      for rank, path in enumerate(os.path.join(log_dir, f"node{r}.log") for r in range(nodes)))
    return f"{what} (rendezvous {endpoint}, id {run_id})\n{tails}"


def _wait_all(agents: Sequence[subprocess.Popen[str]], deadline: float) -> bool:
    """Wait for every agent until ``deadline``; True when the time ran out first."""
    for agent in agents:
        try:
            agent.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            return True
    return False


def _tail(path: str, size: int = 3000) -> str:
    with open(path, errors="replace") as handle:
        return handle.read()[-size:]


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
