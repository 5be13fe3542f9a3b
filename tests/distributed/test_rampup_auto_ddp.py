"""The auto batch ramp on two real CPU processes (torchrun, gloo): every update exact over all ranks (1e-10), one
gradient all-reduce per update, and every rank taking the same decisions (they read only all-reduced values)."""

from __future__ import annotations

import pytest

from hf_accum.testing.launch import job_report


@pytest.fixture(scope="module")
def report(loop_ddp_family):
    return job_report(loop_ddp_family, "rampup_auto")  # the loop DDP family's one launch (conftest.py)


@pytest.mark.slow
def test_auto_ramped_updates_are_exact_over_both_ranks_with_one_allreduce_each(report):
    assert report["world_size"] == 2
    assert max(report["errors"]) < 1e-10, report["errors"]
    assert len(report["errors"]) == report["updates"] == report["allreduce_rounds"]


@pytest.mark.slow
def test_the_batch_grew_and_every_rank_decided_the_same(report):
    sequences = report["sequences"]
    assert sequences[0] == 8 and max(sequences) > 8, sequences
    assert sum(sequences) == 2 * 64
    assert any(report["changes"]) and report["ranks_agree"]
