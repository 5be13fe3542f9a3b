"""AccumGRPOTrainer on 2 real CPU processes (torchrun, gloo) whose ranks hold several-fold different completion
token counts: every loss unit (tokens, completions, completions x length, sequence sums) exact over both ranks,
a short last window included; stock ``trl.GRPOTrainer`` (dapo, bnpo) as the negative control. One torchrun launch
(job ``grpo`` of tests/distributed/trainer_ddp_worker.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from hf_accum.testing.launch import job_report  # noqa: E402

EXACT = 1e-10
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(trainer_ddp_family):
    return job_report(trainer_ddp_family, "grpo")  # the Trainer + TRL family's one launch (conftest.py)


def test_two_processes_with_uneven_counts(report):
    assert report["world_size"] == 2 and report["accum_dapo"]["world_size"] == 2
    rank0, rank1 = (sum(tokens) for tokens in report["accum_dapo"]["first_update_tokens_by_rank"])
    assert rank0 > 2 * rank1


@pytest.mark.parametrize("name", ["accum_dapo", "accum_grpo", "accum_bnpo", "accum_dr_grpo", "accum_luspo",
                                  "accum_grpo_entropy"])
def test_accum_grpo_trainer_is_exact_over_ranks(report, name):
    run = report[name]
    assert run["windows"] == [2, 2, 2]
    assert max(run["errors"]) < EXACT, run["errors"]
    assert run["fused_forwards"] >= 6  # rank 0's micro-batches scored by the fused log-probs


def test_short_last_window_over_ranks(report):
    run = report["accum_dapo_short_window"]
    assert run["windows"] == [4, 2]
    assert max(run["errors"]) < EXACT, run["errors"]


@pytest.mark.parametrize("name", ["stock_dapo", "stock_bnpo"])
def test_stock_grpo_trainer_is_wrong_over_ranks(report, name):
    errors = report[name]["errors"]
    print(f"{name} on 2 ranks: update errors {[f'{e:.3f}' for e in errors]}")
    assert max(errors) > 1e-2, errors
