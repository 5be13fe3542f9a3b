"""AccumTrainer exactness, LR schedule and logging, single process, against an independent big-batch
reference -- with stock ``transformers.Trainer`` run on the same scenarios as the negative control.

Every scenario runs in float64 with dtype-keeping norms (hf_accum/testing/models.py), so "exact" means < 1e-10.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import Trainer

from hf_accum import AccumTrainer
from hf_accum.batching import PackingCollator, PaddingCollator
from hf_accum.testing import (
    PAD,
    ClassificationCollator,
    NoKwargsForCausalLM,
    Scenario,
    random_rows,
    run_trainer,
    tiny_causal_lm,
    tiny_sequence_classifier,
)
from hf_accum.verify import BigBatchAuditor, _concatenate, _shift

EXACT = 1e-10
BROKEN = 1e-3  # a negative control must miss by more than this where stock Trainer is wrong


def _lora_model():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(tiny_causal_lm(), config)


CHECKPOINTING = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}}

# name -> (scenario, what stock Trainer does: "broken" (> 1e-3), "fp32" (right up to its fp32 loss math)).
SCENARIOS = {
    "uneven_right_padding": (
        Scenario("uneven_right_padding", tiny_causal_lm, random_rows(16, seed=1), PaddingCollator(PAD)),
        "fp32",
    ),
    "prompt_masking": (
        Scenario(
            "prompt_masking", tiny_causal_lm, random_rows(16, seed=2, prompt_masking=True), PaddingCollator(PAD)
        ),
        "fp32",
    ),
    "short_last_window_2_epochs": (
        # 11 micro-batches per epoch, K=4: windows of 4, 4, 3 micro-batches; warmup + linear decay.
        Scenario(
            "short_last_window_2_epochs", tiny_causal_lm, random_rows(22, seed=3), PaddingCollator(PAD),
            epochs=2, scheduler="linear", warmup_steps=2,
        ),
        "fp32",
    ),
    "label_smoothing": (
        Scenario(
            "label_smoothing", tiny_causal_lm, random_rows(16, seed=4), PaddingCollator(PAD), label_smoothing=0.3
        ),
        "fp32",
    ),
    "gradient_checkpointing": (
        Scenario(
            "gradient_checkpointing", tiny_causal_lm, random_rows(16, seed=5), PaddingCollator(PAD),
            args=CHECKPOINTING,
        ),
        "fp32",
    ),
    "lora_gradient_checkpointing": (
        Scenario(
            "lora_gradient_checkpointing", _lora_model, random_rows(16, seed=6, prompt_masking=True),
            PaddingCollator(PAD), args=CHECKPOINTING,
        ),
        "fp32",
    ),
    "sequence_classification": (
        Scenario(
            "sequence_classification", tiny_sequence_classifier, random_rows(14, seed=7, num_labels=3),
            ClassificationCollator(), loss_kind="sequence",
        ),
        "broken",  # head accepts **kwargs, ignores num_items_in_batch: K times too large
    ),
    "packed_padding_free": (
        Scenario(
            "packed_padding_free", tiny_causal_lm, random_rows(16, seed=8, prompt_masking=True), PackingCollator()
        ),
        "fp32",
    ),
    "forward_without_kwargs": (
        Scenario(
            "forward_without_kwargs", lambda: NoKwargsForCausalLM(tiny_causal_lm()), random_rows(16, seed=9),
            PaddingCollator(PAD),
        ),
        "broken",  # Trainer averages micro-batch means (each divided by K)
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_gradient_equals_big_batch_and_stock_trainer_is_measured(name, tmp_path):
    scenario, stock_behaviour = SCENARIOS[name]
    ours = run_trainer(scenario, str(tmp_path / "ours"), AccumTrainer)
    stock = run_trainer(scenario, str(tmp_path / "stock"), Trainer)
    print(f"{name}: AccumTrainer max rel. error {ours.max_error:.2e}; stock Trainer {stock.max_error:.2e}")

    assert len(ours.errors) == _big_batch_updates(scenario) > 1
    if scenario.args.get("activation_checkpointing"):  # the scenario really recomputed activations
        model = ours.trainer.model
        assert getattr(model, "get_base_model", lambda: model)().is_activation_checkpointing
    assert ours.max_error < EXACT, ours.errors
    if stock_behaviour == "broken":
        assert stock.max_error > BROKEN, f"negative control: stock Trainer should fail {name}"
    elif name == "label_smoothing":
        # Trainer's LabelSmoother sums the smoothing term in float32: small (it is weighted by eps / V)
        # but over the 1e-10 bar of a float64 run; ours sums in the logits' float64.
        assert stock.max_error > EXACT and stock.max_error > 1e3 * ours.max_error


def test_lr_matches_big_batch_schedule_and_steps_once_per_update(tmp_path):
    scenario, _ = SCENARIOS["short_last_window_2_epochs"]
    run = run_trainer(scenario, str(tmp_path), AccumTrainer)
    expected = scenario.big_batch_learning_rates(_big_batch_updates(scenario))
    assert len(run.lrs) == len(expected) == 6
    assert run.lrs == pytest.approx(expected, rel=0, abs=1e-15)
    assert run.trainer.lr_scheduler.last_epoch == len(run.auditor.records)  # scheduler steps == updates
    assert [log["learning_rate"] for log in run.update_logs] == pytest.approx(expected, abs=1e-15)


def test_lr_with_max_steps_crossing_an_epoch(tmp_path):
    base, _ = SCENARIOS["short_last_window_2_epochs"]
    scenario = Scenario(**{**base.__dict__, "max_steps": 5, "epochs": 1})
    run = run_trainer(scenario, str(tmp_path), AccumTrainer)
    assert run.lrs == pytest.approx(scenario.big_batch_learning_rates(5), abs=1e-15)
    assert run.max_error < EXACT


def test_lr_with_fractional_epochs_that_float_rounding_would_overshoot(tmp_path):
    """20 rows, micro-batch 1, K=2: 10 updates per epoch; 1.1 epochs is 11 updates (a horizon of 12,
    from 0.10000000000000009 * 10 rounded up, would make every LR differ)."""
    scenario = Scenario("fractional_epochs", tiny_causal_lm, random_rows(20, seed=13), PaddingCollator(PAD),
                               micro_batch=1, accumulation=2, epochs=1.1, scheduler="linear")
    run = run_trainer(scenario, str(tmp_path), AccumTrainer)
    assert run.lrs == pytest.approx(scenario.big_batch_learning_rates(11), rel=0, abs=1e-15)


# -- subclassing: a custom loss through the one override point ----------------------------------

def readme_example(tag: str) -> dict:
    """Execute the README's python block that starts with ``# readme-example: <tag>``."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    match = re.search(rf"```python\n(# readme-example: {re.escape(tag)}\n.*?)```", readme.read_text(), re.S)
    assert match, f"README.md has no python block tagged {tag!r}"
    namespace: dict = {}
    exec(compile(match.group(1), "README.md", "exec"), namespace)
    return namespace


class ZLossTrainer(readme_example("z-loss")["ZLossTrainer"]):
    z_weight = 1e-2  # larger than the README's, so that leaving the term out is clearly visible


@dataclass
class ReferenceAuditor(BigBatchAuditor):
    """The stock yardstick, written out again so the loss can grow a z-loss term, and recording each
    window's big-batch loss and shape (for the logging test)."""

    z_weight: float = 0.0
    windows: list = field(default_factory=list)

    def reference_gradient(self, micro_batches):
        reference = self._reference
        reference.load_state_dict(self._live.state_dict())
        reference.zero_grad(set_to_none=True)
        big = _concatenate(micro_batches, self.pad_token_id)
        labels = big.pop("labels")
        logits, labels = _shift(reference(**big, use_cache=False).logits, labels, self.loss_kind)
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        mask = labels.ne(-100)
        loss = F.cross_entropy(logits[mask], labels[mask], label_smoothing=self.label_smoothing)  # mean over targets
        loss = loss + self.z_weight * torch.logsumexp(logits[mask], dim=-1).pow(2).mean()
        loss.backward()
        self.windows.append({
            "loss": float(loss.detach()),
            "targets": int(mask.sum()),
            "sequences": sum(int(b["input_ids"].shape[0]) for b in micro_batches),
            "padding_fraction": 1 - sum(int(b["attention_mask"].sum()) for b in micro_batches)
            / sum(b["attention_mask"].numel() for b in micro_batches),
        })
        grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
        return grads, int(mask.sum()), float(loss.detach())


def test_custom_z_loss_subclass_is_exact(tmp_path):
    scenario, _ = SCENARIOS["prompt_masking"]
    run = run_trainer(scenario, str(tmp_path), ZLossTrainer, auditor=ReferenceAuditor(z_weight=ZLossTrainer.z_weight))
    plain = run_trainer(
        scenario, str(tmp_path / "plain"), AccumTrainer, auditor=ReferenceAuditor(z_weight=ZLossTrainer.z_weight)
    )
    assert run.max_error < EXACT
    assert plain.max_error > BROKEN  # the reference really contains the z term


# -- logging ------------------------------------------------------------------------------------

def test_logs_carry_exact_window_loss_tokens_sequences_padding(tmp_path, caplog):
    scenario, _ = SCENARIOS["short_last_window_2_epochs"]
    auditor = ReferenceAuditor()
    with caplog.at_level(logging.INFO, logger="hf_accum.trainer"):
        run = run_trainer(scenario, str(tmp_path), AccumTrainer, auditor=auditor)
    assert "effective batch 8 = 2 per device x 4 accumulation x 1 process" in caplog.text
    logs = run.update_logs
    assert len(logs) == len(auditor.windows) == 6
    for log, window in zip(logs, auditor.windows):
        assert log["loss"] == pytest.approx(window["loss"], abs=1e-6, rel=0)
        assert log["tokens_per_update"] == window["targets"]
        assert log["sequences_per_update"] == window["sequences"]
        assert log["padding_fraction"] == pytest.approx(window["padding_fraction"], abs=1e-12)
        assert log["grad_norm"] > 0 and log["learning_rate"] >= 0
    assert [w["sequences"] for w in auditor.windows[:3]] == [8, 8, 6]  # the short window is visible


def test_window_without_targets_applies_nothing(tmp_path, caplog):
    examples = random_rows(16, seed=10)
    for example in examples[8:16]:  # the second window (micro-batches 5-8): every label masked
        example["prompt_length"] = len(example["input_ids"])
    scenario = Scenario("no_targets", tiny_causal_lm, examples, PaddingCollator(PAD))
    run = run_trainer(scenario, str(tmp_path), AccumTrainer)
    assert run.grads_were_none == [False, True]  # AdamW skips every parameter: no momentum, no decay
    assert run.max_error < EXACT
    assert run.update_logs[1].get("updates_without_targets") == 1
    assert math.isnan(run.update_logs[1]["loss"])
    # As in the loop: the skipped update consumes no LR schedule step (2 updates, 1 scheduler step).
    assert [u.applied for u in run.trainer.updates] == [True, False]
    assert run.trainer.lr_scheduler.last_epoch == 1


def test_compute_loss_func_is_refused(tmp_path):
    scenario, _ = SCENARIOS["uneven_right_padding"]
    with pytest.raises(ValueError, match="loss_sum_and_count"):
        run_trainer(scenario, str(tmp_path), AccumTrainer, trainer_kwargs={"compute_loss_func": lambda *a, **k: 0})


def test_evaluation_loss_is_the_plain_mean(tmp_path):
    scenario, _ = SCENARIOS["prompt_masking"]
    run = run_trainer(scenario, str(tmp_path), AccumTrainer, max_steps=1)
    trainer = run.trainer
    batch = scenario.collator(scenario.examples[:4])
    with torch.no_grad():
        loss, _, _ = trainer.prediction_step(trainer.model, dict(batch), prediction_loss_only=True)
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))
    assert float(loss) == pytest.approx(float(expected), rel=1e-12)


def _exact_mean_loss(model, collator, examples, batch_size):
    """Independent per-target mean over a whole dataset: summed cross-entropy / total targets."""
    total, targets = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = collator(examples[start : start + batch_size])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"][:, 1:].reshape(-1)
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels, reduction="sum"))
            targets += int(labels.ne(-100).sum())
    return total / targets


@pytest.mark.parametrize("trainer_cls", [AccumTrainer, Trainer])
def test_eval_loss_is_the_per_target_mean_of_the_whole_set(tmp_path, trainer_cls):
    scenario, _ = SCENARIOS["prompt_masking"]
    run = run_trainer(scenario, str(tmp_path), trainer_cls, max_steps=1, per_device_eval_batch_size=3)
    eval_set = random_rows(10, seed=14, prompt_masking=True)
    metrics = run.trainer.evaluate(eval_dataset=eval_set)
    exact = _exact_mean_loss(run.trainer.model, scenario.collator, eval_set, batch_size=3)
    if trainer_cls is AccumTrainer:
        assert metrics["eval_loss"] == pytest.approx(exact, rel=1e-12)
    else:  # negative control: stock Trainer averages per-batch means, weighted by rows
        assert abs(metrics["eval_loss"] - exact) > 1e-6 * exact


def test_final_train_loss_weighs_every_target_alike(tmp_path):
    scenario, _ = SCENARIOS["short_last_window_2_epochs"]
    run = run_trainer(scenario, str(tmp_path), AccumTrainer)
    records = run.auditor.records
    exact = sum(r.reference_loss * r.targets for r in records) / sum(r.targets for r in records)
    (final,) = [log for log in run.logs if "train_loss" in log]
    assert final["train_loss"] == pytest.approx(exact, rel=1e-10)


# -- independent arithmetic of the big-batch run --------------------------------------------------

def _big_batch_updates(scenario: Scenario) -> int:
    if scenario.max_steps > 0:
        return scenario.max_steps
    micro_batches = math.ceil(len(scenario.examples) / scenario.micro_batch)
    return math.ceil(micro_batches / scenario.accumulation) * int(scenario.epochs)


def test_override_returning_another_count_is_caught(tmp_path):
    class MeanNotSum(AccumTrainer):  # a typical mistake: returns a per-micro-batch mean and "1 target"
        def loss_sum_and_count(self, outputs, labels, inputs):
            loss_sum, n_targets = super().loss_sum_and_count(outputs, labels, inputs)
            return loss_sum / n_targets, torch.ones_like(n_targets)

    scenario, _ = SCENARIOS["uneven_right_padding"]
    with pytest.raises(ValueError, match="must return the same count"):
        run_trainer(scenario, str(tmp_path), MeanNotSum)
