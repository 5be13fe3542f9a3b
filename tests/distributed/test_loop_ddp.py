"""Two real CPU processes (torchrun, gloo): exact across ranks with very different token counts,
one gradient all-reduce per update, LR equal to the big-batch run's; a LLaVA with parameters that get no
gradient trains exactly without any DDP argument from the user, where plain DDP stops."""

from __future__ import annotations

import math

import pytest

from hf_accum.testing import big_batch_learning_rates
from hf_accum.testing.launch import job_report


@pytest.fixture(scope="module")
def report(loop_ddp_family):
    """Jobs loop_ddp, llava and llava_plain_ddp of the loop DDP family's one launch (conftest.py)."""
    return {**job_report(loop_ddp_family, "loop_ddp"), "llava": job_report(loop_ddp_family, "llava"),
            "llava_plain_ddp": job_report(loop_ddp_family, "llava_plain_ddp")}


@pytest.mark.slow
def test_two_processes_really_started(report):
    assert report["world_size"] == 2


@pytest.mark.slow
def test_ddp_gradient_equals_big_batch_over_all_ranks(report):
    assert report["updates"] == 6
    assert max(report["exact_errors"]) < 1e-10, report["exact_errors"]


@pytest.mark.slow
def test_naive_ddp_loop_is_wrong(report):
    assert max(report["naive_errors"]) > 1e-3, report["naive_errors"]


@pytest.mark.slow
def test_one_gradient_allreduce_per_update(report):
    assert report["allreduce_rounds"] == report["updates"]


@pytest.mark.slow
def test_ddp_lr_matches_big_batch(report):
    updates_per_epoch = math.ceil(28 / (2 * 3 * 2))
    expected = big_batch_learning_rates(1e-2, 2 * updates_per_epoch, warmup=1)  # the worker scenario: lr 1e-2, linear
    assert report["learning_rates"] == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.slow
def test_ranks_with_different_micro_batch_counts_are_refused(report):
    assert "micro-batches per epoch differ across processes ([7, 6])" in report["uneven_ranks_error"]


@pytest.mark.slow
def test_llava_with_parameters_without_gradients_is_exact_without_a_ddp_kwarg(report):
    """CLIP's post_layernorm gets no gradient (vision_feature_layer=-1): the loop turns DDP's
    find_unused_parameters on as Trainer would, says so once, and keeps one gradient all-reduce per update."""
    run = report["llava"]
    assert run["error"] == "" and run["updates"] == 2
    assert max(run["errors"]) < 1e-10, run["errors"]
    assert run["allreduce_rounds"] == run["updates"]
    assert len(run["ddp_lines"]) == 1 and "find_unused_parameters=True" in run["ddp_lines"][0]


@pytest.mark.slow
def test_plain_ddp_stops_on_parameters_without_gradients(report):
    """Negative control: DDP as accelerator.prepare built it. The first update's gradients are never
    all-reduced (the bucket holding post_layernorm never completes), the second update's forward raises."""
    run = report["llava_plain_ddp"]
    assert "Expected to have finished reduction in the prior iteration" in run["error"]
    assert run["allreduce_rounds"] == 0 and run["ddp_lines"] == []
