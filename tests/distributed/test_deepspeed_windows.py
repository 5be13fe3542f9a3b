"""Planned windows under DeepSpeed on 2 real CPU processes: a ramp-up under ZeRO-2 and a token budget under ZeRO-3,
every update's SGD weight delta equal to the big-batch update of exactly its rows (fp32 rounding: 1e-6, as
tests/distributed/test_deepspeed.py), the LR horizon the planned number of updates, one scheduler step per update."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="pip install 'hf_accum[deepspeed]'"),
]
RUNS = ["loop_zero2_rampup", "loop_zero3_tokens"]


@pytest.fixture(scope="module")
def report(deepspeed_report):
    return deepspeed_report  # the RUNS are jobs of the one launch test_deepspeed.py reads too (conftest.py)


@pytest.mark.parametrize("name", RUNS)
def test_planned_windows_equal_the_big_batch_update(report, name):
    run = report[name]
    assert run["distributed_type"] == "DEEPSPEED" and run["num_processes"] == 2
    assert run["updates"] == len(run["errors"]) == run["scheduler_steps"] == len(run["logged_lrs"]) > 0
    assert max(run["errors"]) < 1e-6, run["errors"]


def test_ramp_windows_grow(report):
    # 7 micro-batches of 2 rows per rank, 2 ranks (4 sequences a round), global batch 12: epoch 1 takes
    # windows of 1, 1, 2, 3 micro-batches (4, 4, 8, 12 sequences), epoch 2 is past the ramp: 3, 3, 1.
    run = report["loop_zero2_rampup"]
    assert run["updates"] == 7 == len(run["targets"])


def test_token_windows_hold_the_budget(report):
    run = report["loop_zero3_tokens"]
    per_epoch = run["updates"] // 2
    for epoch in (run["targets"][:per_epoch], run["targets"][per_epoch:]):
        assert all(t >= 150 for t in epoch[:-1])
