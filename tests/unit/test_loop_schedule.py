"""The LR at every update equals the big-batch run's LR at that update (and the naive horizon,
counted in micro-batches, does not)."""

from __future__ import annotations

import math

import pytest

from hf_accum import testing
from hf_accum.batching import PaddingCollator
from hf_accum.testing import PAD, Scenario, random_rows, run_exact, run_naive, tiny_causal_lm

N_EXAMPLES, MICRO, K, LR = 22, 2, 4, 1e-2


def big_batch_learning_rates(total_updates: int, warmup: int, name: str = "linear") -> list[float]:
    return testing.big_batch_learning_rates(LR, total_updates, warmup, name)


def _scenario(**kwargs) -> Scenario:
    return Scenario(
        "lr", tiny_causal_lm, random_rows(N_EXAMPLES, seed=11), PaddingCollator(PAD), micro_batch=MICRO,
        accumulation=K, lr=LR, scheduler="linear", warmup_steps=2, **kwargs,
    )


def test_lr_matches_big_batch_over_two_epochs_with_short_last_window():
    updates_per_epoch = math.ceil(N_EXAMPLES / (MICRO * K))  # the big batch's last batch is short too
    expected = big_batch_learning_rates(2 * updates_per_epoch, warmup=2)
    result, auditor = run_exact(_scenario(epochs=2))
    applied = [r.learning_rate for r in auditor.records]
    assert applied == pytest.approx(expected, rel=1e-12, abs=0)
    assert [u.learning_rate for u in result.updates] == pytest.approx(expected, rel=1e-12, abs=0)
    assert expected[-1] > 0  # the decay does not end early: the horizon is the true update count


def test_lr_matches_big_batch_with_max_steps_across_epoch_boundary():
    expected = big_batch_learning_rates(4, warmup=2)  # 3 updates per epoch: update 4 is in epoch 2
    result, auditor = run_exact(_scenario(epochs=1, max_steps=4))
    assert len(auditor.records) == len(result.updates) == 4
    assert [r.learning_rate for r in auditor.records] == pytest.approx(expected, rel=1e-12, abs=0)


def test_naive_micro_batch_horizon_stretches_the_schedule():
    expected = big_batch_learning_rates(2 * math.ceil(N_EXAMPLES / (MICRO * K)), warmup=2)
    auditor = run_naive(_scenario(epochs=2))
    applied = [r.learning_rate for r in auditor.records]
    assert len(applied) == len(expected)
    assert max(abs(a - e) for a, e in zip(applied, expected)) > 0.1 * LR


def test_lr_matches_big_batch_with_fractional_epochs():
    """1.1 epochs of 3 updates is ceil(3.3) = 4 updates, as the big-batch Trainer run plans it."""
    expected = big_batch_learning_rates(4, warmup=2)
    result, auditor = run_exact(_scenario(epochs=1.1))
    assert [r.learning_rate for r in auditor.records] == pytest.approx(expected, rel=1e-12, abs=0)
