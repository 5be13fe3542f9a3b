"""Batch-size ramp-up in the Accelerate loop: every update exact in float64 (1e-10), Megatron's sequences per
update, the LR of a run fed the ramp's batches directly, and resume mid-ramp; the naive loop fails the check."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from hf_accum import LoopConfig, train
from hf_accum.batching import PaddingCollator
from hf_accum.checkpointing.checkpoint import ResumeMismatchError
from hf_accum.loop.config import LoopConfigError
from hf_accum.planning.rampup import RampUpError
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
RAMP = [2, 2, 16]  # micro-batch 2, K=4: global 8; per increment 16 / 3 samples
ROWS = 40  # 20 micro-batches per epoch


def megatron_global_batch(consumed: int, start: int, increment: int, samples: int, global_batch: int) -> int:
    """Independent transcription of Megatron-LM's RampupBatchsizeNumMicroBatches.update."""
    if consumed > samples:
        return global_batch
    return start + int(consumed / (samples / ((global_batch - start) // increment))) * increment


def _scenario(**kwargs) -> Scenario:
    values = dict(micro_batch=2, accumulation=4, epochs=2, scheduler="linear", warmup_steps=2,
                  loop_kwargs={"rampup_batch_size": RAMP})
    values.update(kwargs)
    return Scenario("rampup", tiny_causal_lm, random_rows(ROWS, seed=41, prompt_masking=True), PaddingCollator(PAD),
                    **values)


def _expected_sequences(micro_batches: int, epochs: int) -> list[int]:
    """Megatron's batch for the samples consumed before each update; an epoch's last window keeps what is left."""
    sizes, consumed = [], 0
    for _ in range(epochs):
        left = micro_batches * 2
        while left:
            size = min(megatron_global_batch(consumed, *RAMP, 8), left)
            sizes.append(size)
            left -= size
            consumed += size
    return sizes


def test_ramped_updates_equal_the_big_batch_of_their_rows():
    result, auditor = run_exact(_scenario())
    assert len(auditor.records) == len(result.updates) > 0
    errors = [r.relative_error for r in auditor.records]
    assert max(errors) < EXACT, errors
    assert [r.micro_batches for r in auditor.records] == [u.micro_batches for u in result.updates]


def test_naive_loop_fails_the_same_check():
    assert run_naive(_scenario()).max_relative_error > 1e-3


def test_sequences_per_update_follow_megatron():
    result, _ = run_exact(_scenario())
    sequences = [u.sequences for u in result.updates]
    assert sequences == _expected_sequences(ROWS // 2, 2)
    assert {2, 4, 6, 8} <= set(sequences)


def _direct_batches_run(sizes: list[int]) -> list[float]:
    """The reference: a run fed batch B_n directly (one micro-batch of B_n rows, K=1), same scheduler."""
    rows = random_rows(ROWS, seed=41, prompt_masking=True)
    starts, groups = 0, []
    for size in sizes:
        groups.append([(starts + i) % ROWS for i in range(size)])
        starts += size
    accelerator = fresh_accelerator(1)
    model = tiny_causal_lm()
    loader = DataLoader(rows, batch_sampler=groups, collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    config = LoopConfig(num_train_epochs=1, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.0,
                        disable_tqdm=True, loss_kind="causal_lm")
    return [u.learning_rate for u in train(model, optimizer, loader, accelerator, config).updates]


def test_lr_at_update_n_equals_a_run_fed_batch_n_directly():
    result, _ = run_exact(_scenario())
    reference = _direct_batches_run([u.sequences for u in result.updates])
    assert [u.learning_rate for u in result.updates] == pytest.approx(reference, rel=1e-12, abs=0)
    # The horizon is the ramped run's true number of updates: the schedule ends with the run.
    expected = big_batch_learning_rates(1e-2, len(result.updates), warmup=2)
    assert [u.learning_rate for u in result.updates] == pytest.approx(expected, rel=1e-12, abs=0)


def _ramped_run(output_dir, resume=None, ramp=RAMP, **config):
    accelerator = fresh_accelerator(4)
    torch.manual_seed(0)
    model = tiny_causal_lm()
    loader = DataLoader(random_rows(ROWS, seed=41, prompt_masking=True), batch_size=2, shuffle=True,
                        collate_fn=PaddingCollator(PAD))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loop = LoopConfig(num_train_epochs=2, lr_scheduler_type="linear", warmup_steps=2, disable_tqdm=True,
                      output_dir=str(output_dir), save_steps=1, rampup_batch_size=ramp, **config)
    result = train(model, optimizer, loader, accelerator, loop, resume_from_checkpoint=resume)
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return result, weights


@pytest.mark.slow
def test_resume_mid_ramp_is_exact(tmp_path):
    full, weights = _ramped_run(tmp_path / "full")
    # Update 5 is mid-ramp (windows 1, 1, 1, 2, 2, 3, ...): resume there in a fresh run.
    resumed_dir = tmp_path / "full"
    resumed, resumed_weights = _ramped_run(tmp_path / "again", resume=str(resumed_dir / "checkpoint-5"))
    assert [u.sequences for u in resumed.updates] == [u.sequences for u in full.updates]
    assert [u.loss for u in resumed.updates[5:]] == [u.loss for u in full.updates[5:]]
    assert [u.learning_rate for u in resumed.updates] == [u.learning_rate for u in full.updates]
    assert torch.equal(resumed_weights, weights)


def test_resume_under_another_ramp_is_refused(tmp_path):
    _ramped_run(tmp_path / "full", max_steps=5)
    with pytest.raises(ResumeMismatchError, match="other windows"):
        _ramped_run(tmp_path / "other", resume=str(tmp_path / "full" / "checkpoint-5"), ramp=[4, 2, 16], max_steps=5)


@pytest.mark.parametrize("ramp, message", [
    ([2, 2], "three integers"),
    ([0, 2, 16], "three integers"),
    ([2.0, 2, 16], "three integers"),
])
def test_bad_ramp_is_refused_by_the_config(ramp, message):
    with pytest.raises(LoopConfigError, match=message):
        LoopConfig(rampup_batch_size=ramp)


def test_ramp_and_token_budget_are_exclusive():
    with pytest.raises(LoopConfigError, match="one of them"):
        LoopConfig(rampup_batch_size=[2, 2, 16], tokens_per_update=100)


def test_ramp_off_the_micro_batch_grid_names_the_nearest_values():
    with pytest.raises(RampUpError, match="nearest valid start: 2 or 4"):
        run_exact(_scenario(loop_kwargs={"rampup_batch_size": [3, 2, 16]}))


@pytest.mark.parametrize("setting", [{"rampup_batch_size": [2, 2, 16]}, {"tokens_per_update": 100}])
def test_accum_trainer_refuses_and_names_the_loop_engine(setting):
    from hf_accum import AccumTrainer
    from hf_accum.planning.planned_windows import WindowsNeedLoopError

    with pytest.raises(WindowsNeedLoopError, match=r"needs the loop engine \(engine=loop"):
        AccumTrainer(**setting)
