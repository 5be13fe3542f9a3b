"""Token-budget updates in the Accelerate loop: every update exact in float64 (1e-10), each update but an epoch's
last holds >= N targets and < N plus its last micro-batch's, the LR horizon is the number of updates run, the
planning pass sees the training order (shuffled, 2 epochs), and resume is exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.loop.config import LoopConfigError
from hf_accum.loop.windows import budget_windows
from hf_accum.losses.token_loss import count_targets
from hf_accum.testing import (
    PAD,
    Scenario,
    big_batch_learning_rates,
    fresh_accelerator,
    random_rows,
    run_exact,
    run_naive,
    tiny_causal_lm,
)

EXACT = 1e-10
BUDGET = 150
ROWS = random_rows(30, seed=51, min_len=3, max_len=60, prompt_masking=True)  # long-tailed lengths


def _scenario(**kwargs) -> Scenario:
    values = dict(micro_batch=2, accumulation=3, epochs=2, scheduler="linear", warmup_steps=1,
                  loop_kwargs={"tokens_per_update": BUDGET})
    values.update(kwargs)
    return Scenario("token_budget", tiny_causal_lm, ROWS, PaddingCollator(PAD), **values)


def _micro_batch_targets() -> list[int]:
    """Independent count: targets of each micro-batch of the (unshuffled) epoch."""
    collate = PaddingCollator(PAD)
    return [int(count_targets(collate(ROWS[i:i + 2])["labels"])) for i in range(0, len(ROWS), 2)]


def test_token_budget_updates_equal_the_big_batch_of_their_rows():
    result, auditor = run_exact(_scenario())
    errors = [r.relative_error for r in auditor.records]
    assert len(errors) == len(result.updates) > 4
    assert max(errors) < EXACT, errors


def test_naive_loop_fails_the_same_check():
    assert run_naive(_scenario()).max_relative_error > 1e-3


def test_each_update_holds_the_budget_and_less_than_one_more_micro_batch():
    result, _ = run_exact(_scenario(epochs=1))
    counts = _micro_batch_targets()
    position = 0
    for number, update in enumerate(result.updates, start=1):
        window = counts[position:position + update.micro_batches]
        position += update.micro_batches
        assert update.targets == sum(window)
        if number < len(result.updates):
            assert BUDGET <= update.targets < BUDGET + window[-1]
    assert position == len(counts)  # every micro-batch trained, the last window short
    assert len({u.micro_batches for u in result.updates}) > 1  # the window really varies


def test_lr_horizon_is_the_number_of_updates_run():
    result, _ = run_exact(_scenario())
    sizes, _ = budget_windows(_micro_batch_targets(), BUDGET)
    assert len(result.updates) == 2 * len(sizes)
    expected = big_batch_learning_rates(1e-2, len(result.updates), warmup=1)
    assert [u.learning_rate for u in result.updates] == pytest.approx(expected, rel=1e-12, abs=0)


def test_max_steps_ends_the_plan():
    result, _ = run_exact(_scenario(max_steps=3, epochs=5))
    assert len(result.updates) == 3
    expected = big_batch_learning_rates(1e-2, 3, warmup=1)
    assert [u.learning_rate for u in result.updates] == pytest.approx(expected, rel=1e-12, abs=0)


def _shuffled_run(output_dir=None, resume=None, budget=BUDGET, audit=False, epochs=2):
    accelerator = fresh_accelerator(1)
    torch.manual_seed(0)
    model = tiny_causal_lm()
    auditor = _scenario().auditor() if audit else None
    collate = auditor.wrap_collator(PaddingCollator(PAD)) if audit else PaddingCollator(PAD)
    loader = DataLoader(ROWS, batch_size=2, shuffle=True, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if audit:
        auditor.attach(model, optimizer)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(num_train_epochs=epochs, lr_scheduler_type="linear", disable_tqdm=True, max_grad_norm=0.0,
                        output_dir=str(output_dir) if output_dir else None, save_steps=1, tokens_per_update=budget)
    result = train(model, optimizer, loader, accelerator, config, resume_from_checkpoint=resume)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return result, weights, auditor


@pytest.mark.slow
def test_planning_pass_sees_the_shuffled_training_order_every_epoch():
    """The plan is counted before training; training checks every window's targets against it
    (PlanDriftError otherwise), and the epochs' orders differ (so the check is not vacuous)."""
    result, _, auditor = _shuffled_run(audit=True)
    assert max(r.relative_error for r in auditor.records) < EXACT
    per_epoch = len(result.updates) // 2
    first = [u.targets for u in result.updates[:per_epoch]]
    second = [u.targets for u in result.updates[per_epoch:]]
    assert first != second


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    full, weights, _ = _shuffled_run(tmp_path / "full")
    middle = len(full.updates) // 2 + 1  # mid second epoch
    resumed, resumed_weights, _ = _shuffled_run(tmp_path / "again", resume=str(tmp_path / "full" / f"checkpoint-{middle}"))
    assert [u.targets for u in resumed.updates] == [u.targets for u in full.updates]
    assert [u.learning_rate for u in resumed.updates] == [u.learning_rate for u in full.updates]
    assert torch.equal(resumed_weights, weights)


@pytest.mark.parametrize("budget", [0, -5, 2.5, True])
def test_bad_budget_is_refused(budget):
    with pytest.raises(LoopConfigError, match="tokens_per_update"):
        LoopConfig(tokens_per_update=budget)
