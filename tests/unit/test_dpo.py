"""DPO exact over every update: ``AccumDPOTrainer`` (on TRL's own dataset preparation and collator) and
``hf_accum.train(loss_sum_fn=DPOPairLoss(...))`` against an independent big-batch reference
(hf_accum/testing/dpo_reference.py: each sequence forwarded alone, float64 ``log_softmax``, the mean over ALL pairs of the
update, its gradient by autograd); stock ``trl.DPOTrainer`` as the negative control. The 2-process cases are in
tests/distributed/test_dpo_ddp.py.

float64 with dtype-keeping norms, so "exact" means < 1e-10. With 13 pairs, 2 per micro-batch and K = 3, the
windows hold 6, 6 and 1 pairs (micro-batches of 2, 2, 2 | 2, 2, 2 | 1): a 1-pair micro-batch in a short last
window.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from trl import DPOConfig, DPOTrainer  # noqa: E402

from hf_accum import AccumDPOTrainer  # noqa: E402
from hf_accum.errors import InputError  # noqa: E402
from hf_accum.losses.preference import DPOPairLoss  # noqa: E402
from hf_accum.testing.dpo_reference import pair_features, preference_rows, run_dpo_loop, run_dpo_trainer  # noqa: E402
from hf_accum.testing.sft import sft_tokenizer  # noqa: E402

EXACT = 1e-10
TOKENIZER = sft_tokenizer()
ROWS = preference_rows(13, seed=1)
ELEVEN = preference_rows(11, seed=2)  # windows of 6 and 5 pairs: micro-batches 2, 2, 2 | 2, 2, 1
CASES = {
    "sigmoid_live_reference": dict(loss_type=("sigmoid",)),
    "sigmoid_precomputed": dict(loss_type=("sigmoid",), precompute=True),
    "hinge_precomputed": dict(loss_type=("hinge",), precompute=True),
    "ipo_live_reference": dict(loss_type=("ipo",)),
    "robust_precomputed": dict(loss_type=("robust",), label_smoothing=0.2, precompute=True),
    "sigmoid_sft": dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5]),
    "sigmoid_sft_precomputed": dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5], precompute=True),
    "ipo_hinge_mix": dict(loss_type=("ipo", "hinge"), loss_weights=[0.3, 1.0]),
    # TRL adds the adapter (peft_config): the reference is the model with the adapter disabled.
    "peft_adapter_disabled_reference": dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.25], peft="new"),
    # A model with its adapter already: TRL's reference is a frozen copy of that adapter ("ref").
    "peft_existing_adapter_reference": dict(loss_type=("sigmoid",), peft="existing"),
    # The log-probs from the full logits (the fused log-probs are the default).
    "sigmoid_sft_logits_path": dict(loss_type=("sigmoid", "sft"), loss_weights=[1.0, 0.5],
                                    trainer_kwargs={"fused_loss": False}),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each case trained once, on demand, shared by the tests below."""
    cache = {}

    def get(name: str, trainer_cls=AccumDPOTrainer, rows=ROWS):
        key = (name, trainer_cls.__name__, len(rows))
        if key not in cache:
            out = str(tmp_path_factory.mktemp(name))
            cache[key] = run_dpo_trainer(trainer_cls, rows, TOKENIZER, out, **CASES[name])
        return cache[key]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_accum_dpo_trainer_is_exact(runs, name):
    run = runs(name)
    assert run["pairs"] == [6, 6, 1]  # uneven micro-batches, a short last window
    assert max(run["errors"]) < EXACT, run["errors"]
    fused, reference = run["trainer"].dpo_loss.fused, run["trainer"]._reference_logps
    if "fused_loss" in CASES[name].get("trainer_kwargs", {}):
        assert fused is None and reference is None
    else:  # the policy's 7 micro-batches, and the reference's log-probs (live, or TRL's precompute pass), fused
        assert fused.forwards == 7 and reference.forwards >= 7
    # The logged update size is the update's pairs (all of them, not a micro-batch's).
    assert [log["pairs_per_update"] for log in run["logs"]] == run["pairs"]


def test_stock_dpo_trainer_is_off_with_uneven_pairs(runs):
    """TRL divides each micro-batch's pair mean by K: a 1-pair micro-batch weighs 1/3 instead of 1/5."""
    stock = runs("sigmoid_live_reference", DPOTrainer, ELEVEN)
    ours = runs("sigmoid_live_reference", AccumDPOTrainer, ELEVEN)
    print(f"sigmoid, 11 pairs (2,2,2 | 2,2,1): stock DPOTrainer errors {[f'{e:.3f}' for e in stock['errors']]}, "
          f"AccumDPOTrainer {max(ours['errors']):.1e}")
    # Equal micro-batches: TRL's mean of means is the right mean, off only by its float32 log-probs (fused head).
    assert stock["errors"][0] < 1e-5
    assert stock["errors"][1] > 0.05
    assert max(ours["errors"]) < EXACT


def test_stock_dpo_trainer_sft_term_is_off_even_on_equal_pairs(runs):
    """TRL's sft term is a token mean per micro-batch: wrong whenever chosen completions differ in length."""
    stock = runs("sigmoid_sft", DPOTrainer, ELEVEN)
    print(f"sigmoid + 0.5 sft: stock DPOTrainer errors {[f'{e:.3f}' for e in stock['errors']]}")
    assert min(stock["errors"]) > 1e-3


def test_pair_metrics_are_exact_over_the_update(runs):
    """rewards/* and logps/* are means over ALL pairs of the update (logging_steps=1), as the reference
    computes them at the weights the update's forwards saw."""
    run = runs("sigmoid_sft")
    assert len(run["logs"]) == len(run["metrics"]) == 3
    for logged, expected in zip(run["logs"], run["metrics"]):
        for key, value in expected.items():
            assert abs(logged[key] - value) <= 1e-10 * max(1.0, abs(value)), (key, logged[key], value)
    assert run["logs"][-1]["num_tokens"] > run["logs"][0]["num_tokens"] > 0


@pytest.mark.parametrize("name", ["sigmoid_live_reference", "sigmoid_sft"])
def test_logged_loss_is_the_update_mean(runs, name):
    """The logged loss is the big batch's: the pair mean (plus the weighted chosen-token mean) of the update."""
    run = runs(name)
    assert len(run["logs"]) == len(run["losses"]) == 3
    for logged, expected in zip(run["logs"], run["losses"]):
        assert logged["loss"] == pytest.approx(expected, rel=1e-10)
    if name == "sigmoid_sft":
        assert all(0 < log["sft_loss"] < log["loss"] for log in run["logs"])


def test_precomputed_reference_is_kept_in_memory(runs):
    """The precompute pass adds each row's reference log-probs as float64 columns of the dataset in memory: no cache
    file, which a dataset built in memory would keep in a temporary directory of this process's own (TRL 1.16: the
    hand-off from rank 0 to the other ranks, FileNotFoundError there; the 2-process case is in
    tests/distributed/test_dpo_precompute_ddp.py). Values against each sequence scored alone by the initial model."""
    from hf_accum.testing.dpo_reference import dpo_model, sequence_logp

    dataset = runs("sigmoid_precomputed")["trainer"].train_dataset
    stock = runs("sigmoid_precomputed", DPOTrainer)["trainer"].train_dataset
    assert stock.cache_files  # the negative control: TRL hands the values over through a file
    assert dataset.cache_files == []
    assert {dataset.features[key].dtype for key in ("ref_chosen_logps", "ref_rejected_logps")} == {"float64"}
    initial, worst = dpo_model(TOKENIZER), 0.0
    with torch.no_grad():
        for row in dataset:
            for side in ("chosen", "rejected"):
                ids = torch.tensor(row["prompt_ids"] + row[f"{side}_ids"])
                completion = torch.tensor([False] * len(row["prompt_ids"]) + [True] * len(row[f"{side}_ids"]))
                expected = float(sequence_logp(initial, ids, completion)[0])
                worst = max(worst, abs(row[f"ref_{side}_logps"] - expected) / abs(expected))
    assert len(dataset) == len(ROWS) and worst < EXACT, worst


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "apo_zero"])
def test_batch_level_loss_types_are_refused(tmp_path, loss_type):
    args = DPOConfig(output_dir=str(tmp_path), loss_type=[loss_type], report_to="none", bf16=False)
    with pytest.raises(InputError, match=rf"loss_type='{loss_type}'.*sigmoid, hinge, ipo, robust, sft"):
        AccumDPOTrainer("no-model-is-loaded", args=args)


def test_unsupported_settings_are_refused_before_loading(tmp_path):
    args = DPOConfig(output_dir=str(tmp_path), ld_alpha=0.5, report_to="none", bf16=False)
    with pytest.raises(InputError, match="ld_alpha"):
        AccumDPOTrainer("no-model-is-loaded", args=args)


# -- the Accelerate loop with DPOPairLoss -------------------------------------------------------------------

LOOP_CASES = {
    "sigmoid": DPOPairLoss(beta=0.5),
    "ipo": DPOPairLoss(beta=0.5, loss_type="ipo"),
    "robust": DPOPairLoss(beta=0.5, loss_type="robust", label_smoothing=0.2),
    "hinge_sft": DPOPairLoss(beta=0.5, loss_type="hinge", sft_weight=0.5),
    "sigmoid_sft_list": DPOPairLoss(beta=0.5, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3]),
}


@pytest.mark.parametrize("name", list(LOOP_CASES))
def test_loop_with_dpo_pair_loss_is_exact(name):
    run = run_dpo_loop(pair_features(13, seed=3), LOOP_CASES[name])
    assert LOOP_CASES[name].fused.forwards == 7  # the fused log-probs, every micro-batch
    assert run["pairs"] == [6, 6, 1]
    assert max(run["errors"]) < EXACT, run["errors"]
    assert [update.targets for update in run["result"].updates] == run["pairs"]
    assert [update.loss for update in run["result"].updates] == pytest.approx(run["losses"], rel=1e-10)
