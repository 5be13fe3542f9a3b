"""AccumSFTTrainer on 2 real CPU processes (torchrun, gloo) whose ranks hold ~10x different token
counts: exact with ``average_tokens_across_devices`` True and False, TRL's metrics summed over both
ranks; stock TRL ``SFTTrainer`` with False is the negative control. One torchrun launch
(job ``sft`` of tests/distributed/trainer_ddp_worker.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from hf_accum.testing.launch import job_report  # noqa: E402

EXACT = 1e-10
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(trainer_ddp_family):
    return job_report(trainer_ddp_family, "sft")  # the Trainer + TRL family's one launch (conftest.py)


def test_two_processes_really_started(report):
    assert report["world_size"] == 2
    assert all(report[name]["args_world_size"] == 2 for name in ("accum_avg_false", "stock_avg_false"))


@pytest.mark.parametrize("name", ["accum_avg_true", "accum_avg_false"])
def test_accum_sft_trainer_is_exact_over_ranks(report, name):
    run = report[name]
    assert len(run["errors"]) == 2
    assert max(run["errors"]) < EXACT, run["errors"]
    assert [log["tokens_per_update"] for log in run["logs"]] == run["targets"]  # summed over ranks


def test_stock_sft_trainer_without_token_averaging_is_wrong(report):
    errors = report["stock_avg_false"]["errors"]
    print(f"stock SFTTrainer, average_tokens_across_devices=False: max rel. error {max(errors):.2f}; "
          f"AccumSFTTrainer: {max(report['accum_avg_false']['errors']):.1e}")
    assert max(errors) > 1e-1


def test_trl_metrics_count_both_ranks(report):
    """``num_tokens`` counts every rank's input tokens, like stock TRL's; entropy and accuracy are logged."""
    ours, stock = report["accum_avg_false"]["logs"], report["stock_avg_false"]["logs"]
    assert [log["num_tokens"] for log in ours] == [log["num_tokens"] for log in stock]
    assert all("entropy" in log and "mean_token_accuracy" in log for log in ours)
