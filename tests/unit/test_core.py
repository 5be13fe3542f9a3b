"""Unit tests of the core: target counting, token-summed losses, the normalization factor, planning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_accum.accumulation import WindowTally, exact_mean_factor, rescale_gradients_
from hf_accum.losses.token_loss import count_targets, infer_loss_kind, token_loss_sum
from hf_accum.planning.schedule import plan_global_batch, planned_updates, updates_per_epoch
from hf_accum.testing import tiny_causal_lm, tiny_sequence_classifier


def _logits_labels(seed=0, batch=3, length=7, vocab=11, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=generator, dtype=dtype)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    labels[0, :3] = -100  # prompt
    labels[2, 5:] = -100  # padding
    return logits, labels


def test_count_targets_applies_the_causal_shift():
    labels = torch.tensor([[5, 6, 7, -100], [-100, -100, 3, 4]])
    # position 0 is never a target: row 0 -> {6, 7}, row 1 -> {3, 4}
    assert int(count_targets(labels, "causal_lm")) == 4
    assert int(count_targets(labels, "token")) == 5
    assert int(count_targets(torch.tensor([1, -100, 2]), "sequence")) == 2


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_token_loss_sum_matches_torch_mean_times_count(smoothing):
    logits, labels = _logits_labels()
    loss_sum, n = token_loss_sum(logits, labels, "causal_lm", label_smoothing=smoothing)
    reference = F.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100, label_smoothing=smoothing
    )
    assert int(n) == int(labels[:, 1:].ne(-100).sum())
    torch.testing.assert_close(loss_sum / n, reference, rtol=1e-13, atol=0)


def test_chunked_loss_equals_unchunked_in_value_and_gradient():
    logits, labels = _logits_labels(batch=4, length=50)
    logits.requires_grad_(True)
    whole, _ = token_loss_sum(logits, labels, chunk_bytes=None)
    (grad_whole,) = torch.autograd.grad(whole, logits)
    chunked, _ = token_loss_sum(logits, labels, chunk_bytes=16 * 11 * 8)  # 16 rows of 11 float64 logits
    (grad_chunked,) = torch.autograd.grad(chunked, logits)
    torch.testing.assert_close(chunked, whole, rtol=1e-13, atol=0)
    torch.testing.assert_close(grad_chunked, grad_whole, rtol=1e-13, atol=1e-15)


def test_low_precision_logits_are_summed_in_float32():
    logits, labels = _logits_labels(dtype=torch.bfloat16)
    loss_sum, _ = token_loss_sum(logits, labels)
    assert loss_sum.dtype == torch.float32
    reference, _ = token_loss_sum(logits.float(), labels)
    assert float(loss_sum) == pytest.approx(float(reference), rel=1e-6)


def test_sequence_and_regression_heads():
    logits = torch.randn(4, 3, dtype=torch.float64)
    labels = torch.tensor([0, 2, -100, 1])
    loss_sum, n = token_loss_sum(logits, labels, "sequence")
    assert int(n) == 3
    torch.testing.assert_close(loss_sum / n, F.cross_entropy(logits, labels, ignore_index=-100))
    values = torch.randn(4, 1, dtype=torch.float64)
    targets = torch.randn(4, dtype=torch.float64)
    loss_sum, n = token_loss_sum(values, targets, "sequence")
    torch.testing.assert_close(loss_sum / n, F.mse_loss(values.squeeze(-1), targets))


def test_sequence_problem_types_follow_transformers():
    """Regression (one output or problem_type) and multi-label sum per label element; the mean
    equals the loss transformers' own head computes."""
    from transformers import LlamaForSequenceClassification

    from hf_accum.testing import tiny_config

    cases = {
        "regression": (1, torch.randn(4, dtype=torch.float64)),
        "multi_label_classification": (3, torch.randint(0, 2, (4, 3)).to(torch.float64)),
        "single_label_classification": (3, torch.tensor([0, 2, 1, 1])),
    }
    input_ids = torch.randint(3, 40, (4, 6))
    for problem, (num_labels, labels) in cases.items():
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(tiny_config(num_labels=num_labels)).double()
        outputs = model(input_ids=input_ids, labels=labels)  # transformers' own loss, a mean
        loss_sum, n = token_loss_sum(outputs.logits, labels, "sequence")
        assert int(n) == int(count_targets(labels, "sequence")) == (labels.numel() if problem != "single_label_classification" else 4)
        torch.testing.assert_close(loss_sum / n, outputs.loss, rtol=1e-12, atol=0, msg=problem)
        assert model.config.problem_type == problem  # transformers inferred the same problem type
    with pytest.raises(ValueError, match="problem_type='ranking'"):
        token_loss_sum(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), "sequence", problem_type="ranking")


def test_infer_loss_kind_from_model_class():
    assert infer_loss_kind(tiny_causal_lm()) == "causal_lm"
    assert infer_loss_kind(tiny_sequence_classifier()) == "sequence"
    with pytest.raises(ValueError, match="pass loss_kind"):
        infer_loss_kind(torch.nn.Linear(2, 2))


def test_exact_mean_factor_accounts_for_ddp_averaging_and_refuses_zero():
    assert exact_mean_factor(100, 4) == pytest.approx(0.04)
    with pytest.raises(ZeroDivisionError):
        exact_mean_factor(0, 2)


def test_rescale_gradients_touches_only_existing_grads():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.full((2,), 3.0)
    rescale_gradients_([a, b], 0.5)
    assert a.grad.tolist() == [1.5, 1.5] and b.grad is None


def test_window_tally_counts_tokens_sequences_and_padding():
    tally = WindowTally()
    batch = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }
    tally.add(torch.tensor(6.0), torch.tensor(4), batch)
    tally.add(torch.tensor(2.0), torch.tensor(1), batch)
    totals = tally.reduce(accelerator=None)
    assert (totals.targets, totals.sequences, totals.micro_batches) == (5, 4, 2)
    assert totals.mean_loss == pytest.approx(8.0 / 5)
    assert totals.padding_fraction == pytest.approx(0.25)


def test_planned_updates_counts_short_windows_and_max_steps():
    assert updates_per_epoch(11, 4) == 3
    assert planned_updates(11, 4, num_epochs=2) == 6
    assert planned_updates(11, 4, num_epochs=2, max_steps=4) == 4
    assert planned_updates(8, 4, num_epochs=1.5) == 3
    assert planned_updates(20, 2, num_epochs=1.1) == 11  # not 12: 1.1 - 1 is 0.10000000000000009


def test_repeated_examples_warning_names_the_count():
    from hf_accum.planning.schedule import BatchPlan, repeated_examples_warning

    plan = BatchPlan(micro_batch_size=2, accumulation_steps=3, num_processes=2)
    assert "repeats 1 examples" in repeated_examples_warning(27, plan)
    assert repeated_examples_warning(28, plan) is None
    assert repeated_examples_warning(27, plan, even_batches=False) is None
    assert repeated_examples_warning(27, BatchPlan(2, 3, 1)) is None


def test_plan_global_batch_derives_accumulation_and_names_nearest_valid_values():
    plan = plan_global_batch(64, micro_batch_size=4, num_processes=2)
    assert plan.accumulation_steps == 8
    assert plan.describe() == "effective batch 64 = 4 per device x 8 accumulation x 2 processes"
    with pytest.raises(ValueError, match="nearest valid global_batch_size: 56 or 64"):
        plan_global_batch(60, micro_batch_size=4, num_processes=2)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        plan_global_batch(60, micro_batch_size=0)
