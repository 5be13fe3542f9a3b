"""Reward models exact over every update: ``AccumRewardTrainer`` (on TRL's own dataset preparation and collator)
against an independent big-batch reference (hf_accum/testing/reward_reference.py: each sequence scored alone, the
mean over ALL pairs of the update of ``-log sigmoid(c - r - margin) + a * (c + r)^2``, its gradient by autograd);
stock ``trl.RewardTrainer`` as the negative control; and ``hf_accum.train(loss_sum_fn=RewardPairLoss(...))``. The
2-process cases are in tests/distributed/test_reward_ddp.py.

float64 with dtype-keeping norms, so "exact" means < 1e-10. With 11 pairs, 2 per micro-batch and K = 3, the
updates hold 6 and 5 pairs: the second one's micro-batches hold 2, 2 and 1 pairs (a short last micro-batch).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from trl import RewardTrainer  # noqa: E402

from hf_accum import AccumRewardTrainer  # noqa: E402
from hf_accum.errors import InputError  # noqa: E402
from hf_accum.testing.reward_reference import (  # noqa: E402
    reference_loss,
    reward_features,
    reward_rows,
    run_reward_loop,
    run_reward_trainer,
    update_pairs,
)
from hf_accum.testing.sft import sft_tokenizer  # noqa: E402
from hf_accum.trainer.reward import RewardPairLabels  # noqa: E402

EXACT = 1e-10
TOKENIZER = sft_tokenizer()
CASES = {
    "bradley_terry": dict(margins=False, center_rewards_coefficient=None),
    "margin_and_centering": dict(margins=True, center_rewards_coefficient=0.05),
    # TRL adds the adapter (peft_config); the reward head trains in full (modules_to_save=["score"]).
    "lora_bradley_terry": dict(margins=False, center_rewards_coefficient=None, lora=True),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case trained once per trainer, on demand, shared by the tests below."""
    cache = {}

    def get(name: str, trainer_cls=AccumRewardTrainer):
        key = (name, trainer_cls.__name__)
        if key not in cache:
            case = CASES[name]
            rows = reward_rows(11, seed=2, margins=case["margins"])
            cache[key] = run_reward_trainer(trainer_cls, rows, TOKENIZER, str(tmp_path_factory.mktemp(name)),
                                            center_rewards_coefficient=case["center_rewards_coefficient"],
                                            lora=case.get("lora", False))
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_accum_reward_trainer_is_exact(runs, name):
    run = runs(name)
    assert run["pairs"] == [6, 5]  # micro-batches 2, 2, 2 | 2, 2, 1
    assert max(run["errors"]) < EXACT, run["errors"]
    assert [log["pairs_per_update"] for log in run["logs"]] == run["pairs"]


@pytest.mark.parametrize("name", list(CASES))
def test_stock_reward_trainer_is_off_with_a_short_micro_batch(runs, name):
    """TRL divides each micro-batch's pair mean by K: the 1-pair micro-batch weighs 1/3 instead of 1/5."""
    stock, ours = runs(name, RewardTrainer), runs(name)
    print(f"{name}, 11 pairs (2,2,2 | 2,2,1): stock RewardTrainer errors {[f'{e:.3f}' for e in stock['errors']]}, "
          f"AccumRewardTrainer {max(ours['errors']):.1e}")
    assert stock["errors"][0] < 1e-12  # equal micro-batches: the mean of means is the mean
    assert stock["errors"][1] > 0.1
    assert max(ours["errors"]) < EXACT


@pytest.mark.parametrize("name", list(CASES))
def test_logged_loss_and_metrics_are_the_updates(runs, name):
    """The logged loss and TRL's metrics (accuracy, margin, mean/min/max reward) are over ALL pairs of the update
    (logging_steps=1), as the reference computes them at the weights the update's forwards saw."""
    run = runs(name)
    assert len(run["logs"]) == len(run["losses"]) == len(run["metrics"]) == 2
    for logged, loss, metrics in zip(run["logs"], run["losses"], run["metrics"]):
        assert logged["loss"] == pytest.approx(loss, rel=1e-10)
        for key, value in metrics.items():
            assert abs(logged[key] - value) <= 1e-10 * max(1.0, abs(value)), (key, logged[key], value)
    assert run["logs"][-1]["num_tokens"] > run["logs"][0]["num_tokens"] > 0


def test_stock_metrics_are_not_the_updates(runs):
    """Stock TRL logs per-micro-batch extremes averaged over micro-batches: not the update's."""
    run = runs("bradley_terry", RewardTrainer)
    assert any(abs(log["min_reward"] - metrics["min_reward"]) > 1e-3
               for log, metrics in zip(run["logs"], run["metrics"]))


def test_eval_loss_is_the_mean_over_all_evaluation_pairs(runs):
    """``evaluate`` on 5 pairs in batches of 2 (2, 2, 1): the eval loss and metrics are over all 5 pairs."""
    trainer = runs("margin_and_centering")["trainer"]
    recorded: list[dict] = []
    collator = trainer.data_collator

    def record(examples):
        batch = collator(examples)
        recorded.append({key: value.clone() for key, value in batch.items() if torch.is_tensor(value)})
        return batch

    trainer.data_collator = record
    trainer.args.per_device_eval_batch_size = 2
    metrics = trainer.evaluate(eval_dataset=reward_rows(5, seed=9, margins=True))
    pairs = update_pairs([recorded])[0]
    assert len(pairs) == 5
    model = trainer.model.eval()
    with torch.no_grad():
        expected = float(reference_loss(model, pairs, 0.05))
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-10)
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and metrics["eval_min_reward"] <= metrics["eval_max_reward"]


def test_margins_keep_float64():
    """TRL's collator builds margins in float32; the trainer takes them again from the examples."""
    examples = [{"chosen_ids": [7, 8, 5], "rejected_ids": [9, 5], "margin": 0.1},
                {"chosen_ids": [7, 5], "rejected_ids": [10, 11, 5], "margin": -0.3}]
    from trl.trainer.reward_trainer import DataCollatorForPreference

    batch = RewardPairLabels(DataCollatorForPreference(pad_token_id=0))(examples)
    assert batch["margin"].dtype == torch.float64 and batch["margin"].tolist() == [0.1, -0.3]
    assert batch["labels"].tolist() == [1, 1]
    assert batch["input_ids"].shape[0] == 4


def test_kto_is_refused_by_name():
    """No window-level KL baseline is defined: importing it says why, as an InputError and an ImportError."""
    with pytest.raises(InputError, match="KL baseline per micro-batch"):
        from hf_accum import AccumKTOTrainer  # noqa: F401
    with pytest.raises(ImportError, match="AccumKTOTrainer"):
        import hf_accum

        hf_accum.AccumKTOTrainer  # noqa: B018


# -- the Accelerate loop with RewardPairLoss ------------------------------------------------------------------

@pytest.mark.parametrize("center", [None, 0.05])
def test_loop_with_reward_pair_loss_is_exact(center):
    run = run_reward_loop(reward_features(11, seed=3, margins=center is not None), TOKENIZER,
                          center_rewards_coefficient=center)
    assert run["pairs"] == [6, 5]  # micro-batches 2, 2, 2 | 2, 2, 1
    assert max(run["errors"]) < EXACT, run["errors"]
    assert [update.targets for update in run["result"].updates] == run["pairs"]
