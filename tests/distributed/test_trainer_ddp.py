"""AccumTrainer on 2 real CPU processes (torchrun, gloo) whose ranks hold ~10x different token counts:
exact with ``average_tokens_across_devices`` True and False; stock Trainer with False is the
negative control. Job ``trainer_ddp`` of the family launch (tests/distributed/trainer_ddp_worker.py)."""

from __future__ import annotations

import math

import pytest

from hf_accum.testing.cases.trainer_ddp_case import ACCUMULATION, EPOCHS, EXAMPLES, MICRO_BATCH, scenario
from hf_accum.testing.launch import job_report


@pytest.fixture(scope="module")
def report(trainer_ddp_family):
    """Launched with torchrun (`accelerate launch --cpu --num_processes 2` silently starts ONE process)."""
    return job_report(trainer_ddp_family, "trainer_ddp")  # the Trainer + TRL family's one launch (conftest.py)


@pytest.mark.slow
def test_two_processes_really_started(report):
    assert report["world_size"] == 2
    assert all(report[name]["args_world_size"] == 2 for name in ("accum_avg_true", "stock_avg_false"))


def test_ranks_hold_very_different_token_counts():
    examples = scenario().examples
    per_rank = [0, 0]
    for index, example in enumerate(examples):
        per_rank[(index // MICRO_BATCH) % 2] += len(example["input_ids"]) - 1
    assert per_rank[0] > 5 * per_rank[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["accum_avg_true", "accum_avg_false"])
def test_accum_trainer_is_exact_over_ranks(report, name):
    run = report[name]
    updates = EPOCHS * math.ceil(math.ceil(EXAMPLES / MICRO_BATCH / 2) / ACCUMULATION)
    assert len(run["errors"]) == updates == 6
    assert max(run["errors"]) < 1e-10, run["errors"]
    assert run["logged_tokens"] == run["targets"]  # tokens per update, summed over ranks
    assert run["plan"] == "effective batch 12 = 2 per device x 3 accumulation x 2 processes"


@pytest.mark.slow
def test_stock_trainer_without_token_averaging_is_wrong(report):
    errors = report["stock_avg_false"]["errors"]
    print(f"stock Trainer, average_tokens_across_devices=False: max rel. error {max(errors):.2f}; "
          f"True: {max(report['stock_avg_true']['errors']):.1e}")
    assert max(errors) > 1e-3


@pytest.mark.slow
def test_ddp_lr_matches_big_batch_and_steps_once_per_update(report):
    expected = scenario().big_batch_learning_rates(6)
    for name in ("accum_avg_true", "accum_avg_false"):
        assert report[name]["learning_rates"] == pytest.approx(expected, abs=1e-15)
        assert report[name]["scheduler_steps"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["accum_avg_true", "accum_avg_false"])
def test_eval_loss_over_ranks_counts_each_held_out_row_once(report, name):
    """10 held-out rows, batches of 3 on 2 ranks: Accelerate repeats 2 rows in the last step so both
    ranks run 2 batches. eval_loss is still the per-target mean of the 10 rows (computed row by row)."""
    run = report[name]
    assert run["eval_loss"] == pytest.approx(run["independent_eval_loss"], rel=1e-12)


@pytest.mark.slow
def test_stock_eval_loss_over_ranks_is_not_the_per_target_mean(report):
    run = report["stock_avg_true"]  # negative control: per-batch means, the repeated rows included
    assert abs(run["eval_loss"] - run["independent_eval_loss"]) > 1e-6 * run["independent_eval_loss"]


@pytest.mark.slow
def test_resume_on_another_world_size_is_refused(report, tmp_path):
    """A checkpoint trained on 2 processes, resumed on 1 with the same micro-batch and accumulation:
    the effective batch would halve, so AccumTrainer refuses and names the difference."""
    from hf_accum import AccumTrainer
    from hf_accum.testing import run_trainer

    with pytest.raises(ValueError, match="number of processes 2 -> 1"):
        run_trainer(scenario(), str(tmp_path), AccumTrainer, resume_from_checkpoint=report["two_process_checkpoint"])
