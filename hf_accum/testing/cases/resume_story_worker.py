"""Subprocess worker: several runs of the interrupted-run story (:mod:`hf_accum.testing.interruptions`) for one
start-up of Python (torch, transformers, PEFT, accelerate: ~5 CPU-s, most of a story run's cost).

``python resume_story_worker.py REPORT.json STEPS.json``; ``STEPS.json`` lists the runs in order, each
``{"engine": "loop"|"trainer", "out": OUT, "tag": TAG, "injections": [...]}`` (the resume workers' command line).

* One process (``--fork``): each run is a process of its own, forked from this one once the imports are done (no
  computation has run in this process: nothing of torch's thread pools is inherited), that runs the resume worker
  and ends as its script would: killed by its own real SIGKILL, exit 75 after the SIGTERM it sent itself, 1 with a
  traceback, or 0. This process waits for each and writes ``REPORT.json``: per run its exit code as
  :mod:`subprocess` reports it (``-9`` for SIGKILL), its stderr, and what the run left in ``OUT/run``.
* Under torchrun (no ``--fork``): the runs one after the other in this process (runs that nothing kills, e.g.
  both engines' completing resume in one launch); ``REPORT.json`` (rank 0) lists their tags.
"""

from __future__ import annotations

from hf_accum.startup import keep_bitsandbytes_out

keep_bitsandbytes_out()  # first: no job here quantizes, and PEFT imports bitsandbytes (~1.5 CPU-s) if it can

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from hf_accum.distributed import leave_process_group  # noqa: E402
from hf_accum.testing.cases import loop_resume_worker, trainer_resume_worker  # noqa: E402
from hf_accum.testing.interruptions import left_behind, parse_args  # noqa: E402

WORKERS = {"loop": loop_resume_worker, "trainer": trainer_resume_worker}


def run_step(step: dict[str, Any]) -> None:
    WORKERS[step["engine"]].run(parse_args([step["out"], step["tag"], *step["injections"]]))


def fork_step(step: dict[str, Any]) -> int:
    """Fork the process that runs ``step`` (its stdout and stderr to ``OUT/stderr-TAG.txt``); its pid, or 0 in the
    child itself."""
    log = os.path.join(step["out"], f"stderr-{step['tag']}.txt")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, 1)
        os.dup2(handle, 2)
        os.close(handle)
    return pid


def run_forked(steps: list[dict[str, Any]], report: str) -> None:
    ended = []
    for step in steps:
        pid = fork_step(step)
        if pid == 0:  # the run's own process: it returns to the script's end and exits as the worker script would
            run_step(step)
            return
        _, status = os.waitpid(pid, 0)
        with open(os.path.join(step["out"], f"stderr-{step['tag']}.txt"), errors="replace") as handle:
            stderr = handle.read()
        ended.append({"returncode": os.waitstatus_to_exitcode(status), "stderr": stderr,
                      "left": left_behind(step["out"])})
    with open(report, "w") as handle:
        json.dump(ended, handle)


def run_in_order(steps: list[dict[str, Any]], report: str) -> None:
    for step in steps:
        run_step(step)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(report, "w") as handle:
            json.dump([step["tag"] for step in steps], handle)


def main(argv: list[str]) -> None:
    fork = "--fork" in argv
    report, steps_file = [arg for arg in argv if arg != "--fork"]
    with open(steps_file) as handle:
        steps = json.load(handle)
    if fork:
        run_forked(steps, report)
    else:
        run_in_order(steps, report)


if __name__ == "__main__":
    main(sys.argv[1:])
    leave_process_group()
