"""The Accelerate loop applies the float64 big-batch gradient at every update (1e-10 relative),
and the naive `loss / K` loop fails the very same checks (negative control)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_accum.batching import PackingCollator, PaddingCollator
from hf_accum.testing import (
    PAD,
    ClassificationCollator,
    Scenario,
    random_rows,
    run_exact,
    run_naive,
    tiny_causal_lm,
    tiny_sequence_classifier,
)

EXACT = 1e-10
NAIVE_IS_WRONG = 1e-3


def _lora_model():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_causal_lm(), config)
    return model.to(torch.float64)


def _checkpointed_model():
    model = tiny_causal_lm()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


SCENARIOS = {
    "right_padding": Scenario("right_padding", tiny_causal_lm, random_rows(16), PaddingCollator(PAD)),
    "prompt_masking": Scenario(
        "prompt_masking", tiny_causal_lm, random_rows(16, seed=1, prompt_masking=True), PaddingCollator(PAD)
    ),
    # 11 micro-batches per epoch with K=4: windows of 4, 4 and a short 3, twice.
    "short_last_window_2_epochs": Scenario(
        "short_last_window_2_epochs", tiny_causal_lm, random_rows(22, seed=2), PaddingCollator(PAD), epochs=2
    ),
    "label_smoothing": Scenario(
        "label_smoothing", tiny_causal_lm, random_rows(16, seed=3), PaddingCollator(PAD), label_smoothing=0.1
    ),
    "gradient_checkpointing": Scenario(
        "gradient_checkpointing", _checkpointed_model, random_rows(16, seed=4), PaddingCollator(PAD)
    ),
    "peft_lora": Scenario("peft_lora", _lora_model, random_rows(16, seed=5, prompt_masking=True),
                          PaddingCollator(PAD)),
    "sequence_classification": Scenario(
        "sequence_classification",
        tiny_sequence_classifier,
        # 13 rows, micro-batch 2, K=3: windows of 6, 6 and a short one of 1 row.
        random_rows(13, seed=6, num_labels=3),
        ClassificationCollator(),
        accumulation=3,
        loss_kind="sequence",
    ),
    "sequence_regression": Scenario(
        "sequence_regression", lambda: tiny_sequence_classifier(num_labels=1), random_rows(13, seed=9, num_labels=3),
        ClassificationCollator("regression"), accumulation=3, loss_kind="sequence",
    ),
    "sequence_multi_label": Scenario(
        "sequence_multi_label", tiny_sequence_classifier, random_rows(13, seed=10, num_labels=3),
        ClassificationCollator("multi_label"), accumulation=3, loss_kind="sequence",
    ),
    "packed_position_ids": Scenario(
        "packed_position_ids", tiny_causal_lm, random_rows(18, seed=7, prompt_masking=True), PackingCollator(),
        micro_batch=3, accumulation=4,
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_loop_gradient_equals_big_batch(name):
    scenario = SCENARIOS[name]
    result, auditor = run_exact(scenario)
    assert len(auditor.records) == len(result.updates) > 0
    errors = [r.relative_error for r in auditor.records]
    assert max(errors) < EXACT, f"{name}: relative gradient errors {errors}"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_naive_loop_fails_the_same_check(name):
    """Negative control: dividing micro-batch means by K is measurably wrong on these scenarios."""
    auditor = run_naive(SCENARIOS[name])
    assert auditor.max_relative_error > NAIVE_IS_WRONG, f"{name}: naive error {auditor.max_relative_error}"


def test_logged_loss_is_exact_window_mean():
    result, auditor = run_exact(SCENARIOS["short_last_window_2_epochs"])
    for update, record in zip(result.updates, auditor.records, strict=True):
        assert update.loss == pytest.approx(record.reference_loss, rel=1e-6)
        assert update.targets == record.targets
        assert update.micro_batches == record.micro_batches
    assert [u.micro_batches for u in result.updates] == [4, 4, 3, 4, 4, 3]


def test_window_without_targets_applies_no_update():
    examples = random_rows(8, seed=8)
    for example in examples[4:]:
        example["prompt_length"] = len(example["input_ids"])  # every label of window 2 masked
    scenario = Scenario("empty_window", tiny_causal_lm, examples, PaddingCollator(PAD), micro_batch=2, accumulation=2)
    captured = {}

    def snapshot(model):
        captured["model"] = model

    result, auditor = run_exact(scenario, on_model=snapshot)
    assert [u.applied for u in result.updates] == [True, False]
    assert result.updates[1].targets == 0 and result.updates[1].grad_norm is None
    assert len(auditor.records) == 1  # optimizer.step was called once only


def test_stream_without_length_runs_max_steps_exactly():
    """An IterableDataset (no __len__) works with max_steps: windows are closed by accumulate()."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __init__(self, examples):
            self.examples = examples

        def __iter__(self):
            return iter(self.examples)

    scenario = Scenario("stream", tiny_causal_lm, Stream(random_rows(22, seed=12)), PaddingCollator(PAD),
                        max_steps=4)
    result, auditor = run_exact(scenario)
    assert len(result.updates) == len(auditor.records) == 4  # 3 windows in pass 1 (4, 4, 3), then pass 2
    assert [u.micro_batches for u in result.updates] == [4, 4, 3, 4]
    assert auditor.max_relative_error < EXACT


def test_stream_without_max_steps_is_refused():
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(random_rows(4))

    with pytest.raises(ValueError, match="max_steps"):
        run_exact(Scenario("stream", tiny_causal_lm, Stream(), PaddingCollator(PAD)))


def test_sync_with_dataloader_false_is_refused():
    from accelerate.utils import GradientAccumulationPlugin

    from hf_accum.loop import LoopConfig, train
    from hf_accum.testing import fresh_accelerator

    accelerator = fresh_accelerator(
        1, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=False)
    )
    loader = accelerator.prepare(torch.utils.data.DataLoader(random_rows(8), batch_size=2,
                                                             collate_fn=PaddingCollator(PAD)))
    model = tiny_causal_lm()
    with pytest.raises(ValueError, match="sync_with_dataloader=True"):
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, accelerator, LoopConfig())
