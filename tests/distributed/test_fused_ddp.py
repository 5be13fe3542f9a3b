"""The fused loss on 2 real CPU processes (torchrun, gloo): exact over ranks with very different token
counts, one gradient all-reduce per update as on the logits path, and working with Trainer's default
``find_unused_parameters=True`` (job ``fused`` of tests/distributed/loop_ddp_worker.py)."""

from __future__ import annotations

import pytest

from hf_accum.testing.launch import job_report

EXACT = 1e-10


@pytest.fixture(scope="module")
def report(loop_ddp_family):
    return job_report(loop_ddp_family, "fused")  # the loop DDP family's one launch (conftest.py)


@pytest.mark.slow
def test_two_processes_really_started(report):
    assert report["world_size"] == 2


@pytest.mark.slow
def test_loop_is_exact_with_the_fused_loss_and_all_reduces_once_per_update(report):
    fused, logits = report["loop_fused"], report["loop_logits"]
    assert fused["fused"] and not logits["fused"]
    assert fused["updates"] == logits["updates"] == 3
    assert max(fused["errors"]) < EXACT and max(logits["errors"]) < EXACT, (fused["errors"], logits["errors"])
    assert fused["allreduce_rounds"] == logits["allreduce_rounds"] == fused["updates"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer_plain", "trainer_modules_to_save"])
def test_accum_trainer_is_exact_with_find_unused_parameters(report, name):
    run = report[name]
    assert run["fused"] and run["find_unused_parameters"] is True
    assert len(run["errors"]) == 3 and max(run["errors"]) < EXACT, run["errors"]


@pytest.mark.slow
def test_no_run_fell_back(report):
    assert report["fused_off_lines"] == 0
