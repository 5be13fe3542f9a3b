"""Ramp-up and token budgets on two real CPU processes (torchrun, gloo): exact over all ranks (1e-10), one
gradient all-reduce per update, Megatron's batches, token windows closed on the global count, LR horizon."""

from __future__ import annotations

import pytest

from hf_accum.testing import big_batch_learning_rates
from hf_accum.testing.launch import job_report

BUDGET = 120


@pytest.fixture(scope="module")
def report(loop_ddp_family):
    return job_report(loop_ddp_family, "loop_windows")  # the loop DDP family's one launch (conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rampup", "tokens"])
def test_exact_over_both_ranks_with_one_allreduce_per_update(report, name):
    assert report["world_size"] == 2
    run = report[name]
    assert max(run["errors"]) < 1e-10, run["errors"]
    assert len(run["errors"]) == run["updates"] == run["allreduce_rounds"]
    assert run["learning_rates"] == pytest.approx(big_batch_learning_rates(1e-2, run["updates"], warmup=1),
                                                  rel=1e-12, abs=0)


@pytest.mark.slow
def test_ramp_follows_megatron_on_the_global_batch(report):
    # 28 sequences per epoch; one increment per 16 / 2 = 8 samples: consumed 0, 4 -> 4; 8 -> 8; 16 -> 12.
    sequences = report["rampup"]["sequences"]
    assert sequences[:4] == [4, 4, 8, 12]
    assert sum(sequences) == 2 * 28


@pytest.mark.slow
def test_token_windows_close_on_the_global_count(report):
    run = report["tokens"]
    per_epoch = run["updates"] // 2
    for epoch in (run["targets"][:per_epoch], run["targets"][per_epoch:]):
        assert all(t >= BUDGET for t in epoch[:-1])
    assert len(set(run["micro_batches"])) > 1
