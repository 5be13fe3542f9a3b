"""Fixtures the distributed tests share: one torchrun launch per family of checks (loop DDP, Trainer + TRL, FSDP2,
DeepSpeed), each running a job table (hf_accum/testing/jobs.py), made on first use and read by every test of the
family through ``job_report(family, job)``. Process start-up (torch, transformers, accelerate, TRL, DeepSpeed
imports in 2 processes) costs more than most checks, so it is paid once per family."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest

from hf_accum.recipe.testing import recipe_arguments, run_main
from hf_accum.testing.cases.recipe_runs_case import engine_run
from hf_accum.testing.launch import job_report, run_torchrun

HERE = os.path.dirname(__file__)


def run_on_one_process(out: Path, *overrides: str) -> Path:
    """The recipe with ``overrides`` on one process, in the pytest process (``run_main``: no launch, no second
    start-up); it must exit 0. Returns ``out``."""
    proc = run_main(*recipe_arguments(out, *overrides))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="session")
def one_process_run() -> Callable[..., Path]:
    """``one_process_run(out, *overrides)``: a recipe run's big-batch reference, the same command on ONE process in
    the pytest process (:func:`run_on_one_process`), for the tests that compare a 2-process run with it."""
    return run_on_one_process


@pytest.fixture(scope="session")
def reference_recipe_run(tmp_path_factory) -> Callable[[str], Path]:
    """engine -> the output directory of the recipe's 10-update run on one process (:func:`run_on_one_process`),
    made on first use: the reference the DeepSpeed and FSDP recipe tests compare their 2-process runs with (the
    same global batch of 32 -- 8 x 4 here, 8 x 2 x 2 there -- so the same rows in each update; the same command
    for both, ``hf_accum.testing.cases.recipe_runs_case.engine_run``). Read only: the tests copy what they cut."""
    made: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in made:
            out = tmp_path_factory.mktemp(f"one_process_{engine}") / "reference"
            made[engine] = run_on_one_process(out, *engine_run(engine))
        return made[engine]

    return get


class DeepSpeedReport(Mapping[str, Any]):
    """deepspeed_worker.py's job table read as ``report[job]`` (the job's result; a job that raised fails the test
    reading it with its traceback), ``report["fused_logs"][job]`` and ``report["world_size"]``."""

    def __init__(self, family: dict[str, Any]) -> None:
        self.family = family

    def __getitem__(self, name: str) -> Any:
        if name == "fused_logs":
            return {job: entry["fused_log"] for job, entry in self.family.items()
                    if isinstance(entry, dict) and "fused_log" in entry}
        entry = job_report(self.family, name)
        return entry if name == "world_size" else entry["result"]

    def __iter__(self) -> Iterator[str]:
        return iter(self.family)

    def __len__(self) -> int:
        return len(self.family)


@pytest.fixture(scope="session")
def deepspeed_report(tmp_path_factory) -> DeepSpeedReport:
    """ONE torchrun launch of deepspeed_worker.py running all its jobs, read by test_deepspeed.py and
    test_deepspeed_windows.py (the planned-window jobs are among them): DeepSpeed's start-up in 2 processes
    (~25 CPU-s) dominates a launch, so it is paid once. Read only."""
    worker = os.path.join(HERE, "deepspeed_worker.py")
    return DeepSpeedReport(run_torchrun(worker, tmp_path_factory.mktemp("zero") / "report.json", timeout=900))


@pytest.fixture(scope="session")
def loop_ddp_family(tmp_path_factory) -> dict[str, Any]:
    """ONE launch of loop_ddp_worker.py: the loop engine under DDP (exactness, windows, fused loss, per-sequence
    normalization, noise scale, MoE and encoder-decoders, compile). Read only."""
    return run_torchrun(os.path.join(HERE, "loop_ddp_worker.py"), tmp_path_factory.mktemp("loop_ddp") / "report.json",
                        timeout=1800)


@pytest.fixture(scope="session")
def trainer_ddp_family(tmp_path_factory) -> dict[str, Any]:
    """ONE launch of trainer_ddp_worker.py: AccumTrainer and the TRL drop-ins (SFT, DPO, GRPO, reward) under DDP,
    with the stock trainers as negative controls. Read only."""
    return run_torchrun(os.path.join(HERE, "trainer_ddp_worker.py"),
                        tmp_path_factory.mktemp("trainer_ddp") / "report.json", timeout=1800)


@pytest.fixture(scope="session")
def fsdp_family(tmp_path_factory) -> dict[str, Any]:
    """ONE launch of fsdp_worker.py: the loop engine under Accelerate's FSDP2 and AccumTrainer under Trainer's own
    FSDP2. Read only."""
    return run_torchrun(os.path.join(HERE, "fsdp_worker.py"), tmp_path_factory.mktemp("fsdp") / "report.json",
                        timeout=1800)
