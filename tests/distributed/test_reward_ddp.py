"""Reward models on 2 real CPU processes (torchrun, gloo) whose ranks hold different numbers of pairs
(``even_batches=False``): AccumRewardTrainer and the loop with RewardPairLoss exact over both ranks (the trainer's
loss and metrics too), the trainer's evaluation counting every pair once when Accelerate repeats some to even out
the ranks; stock ``RewardTrainer`` with ``even_batches=True`` (a repeated pair) as the negative control. One torchrun launch
(job ``reward`` of tests/distributed/trainer_ddp_worker.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from hf_accum.testing.launch import job_report  # noqa: E402

EXACT = 1e-10
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(trainer_ddp_family):
    return job_report(trainer_ddp_family, "reward")  # the Trainer + TRL family's one launch (conftest.py)


@pytest.mark.parametrize("name", ["accum_bradley_terry", "accum_margin_centering"])
def test_accum_reward_trainer_is_exact_over_uneven_ranks(report, name):
    run = report[name]
    assert report["world_size"] == 2
    assert run["pairs"] == run["distinct_pairs"] == [8, 7]  # every pair once: none repeated to even out the ranks
    assert max(run["errors"]) < EXACT, run["errors"]
    assert [log["pairs_per_update"] for log in run["logs"]] == run["pairs"]


@pytest.mark.parametrize("name", ["accum_bradley_terry", "accum_margin_centering"])
def test_loss_and_metrics_sum_both_ranks(report, name):
    run = report[name]
    for logged, loss, metrics in zip(run["logs"], run["losses"], run["metrics"], strict=True):
        assert logged["loss"] == pytest.approx(loss, rel=1e-10)
        for key, value in metrics.items():
            assert abs(logged[key] - value) <= 1e-10 * max(1.0, abs(value)), (key, logged[key], value)


def test_evaluation_counts_repeated_pairs_once(report):
    evaluation = report["evaluation"]
    assert evaluation["evaluated_pairs"] == 8 and evaluation["distinct_pairs"] == 5  # 3 repeated by Accelerate
    assert evaluation["metrics"]["eval_loss"] == pytest.approx(evaluation["reference_loss"], rel=1e-10)


def test_stock_reward_trainer_is_off(report):
    """Stock RewardTrainer needs even_batches=True (its metric all-gathers fail on uneven ranks), which trains one
    pair twice: the second update is off against the mean over its distinct pairs."""
    run = report["stock_even_batches"]
    print(f"stock RewardTrainer, 2 ranks: errors {[f'{e:.3f}' for e in run['errors']]}, pairs {run['pairs']} "
          f"(distinct {run['distinct_pairs']}); AccumRewardTrainer: {max(report['accum_bradley_terry']['errors']):.1e}")
    assert run["pairs"] == [8, 8] and run["distinct_pairs"] == [8, 7]
    assert run["errors"][1] > 0.1


def test_loop_with_reward_pair_loss_is_exact_over_uneven_ranks(report):
    run = report["loop_margin_centering"]
    assert run["pairs"] == run["targets"] == [8, 7]
    assert max(run["errors"]) < EXACT, run["errors"]
