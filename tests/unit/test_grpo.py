"""AccumGRPOTrainer against an independent float64 reference, every optimizer update, every TRL 1.16 loss_type.

The harness (hf_accum/testing/grpo_reference.py) builds the trainer exactly like ``trl.GRPOTrainer``, replaces generation at
``_generate_and_score_completions`` by fixed completions of 1..7 tokens, and compares each update's applied gradient
with the gradient of the loss type's formula over all the update's completions, each forwarded alone in float64.
Default layout: 12 prompts x 2 generations, 2 completions per micro-batch, ``gradient_accumulation_steps=2`` and
``steps_per_generation=3`` (updates span two generation batches). Stock ``trl.GRPOTrainer`` is the control: exact
for ``grpo`` / ``dr_grpo`` (which validates the reference), off for ``dapo`` and ``bnpo``. The 2-process case is in
tests/distributed/test_grpo_ddp.py.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402

from hf_accum import AccumGRPOTrainer  # noqa: E402
from hf_accum.testing.grpo_reference import build_trainer, trained_rows, update_errors  # noqa: E402
from hf_accum.trainer.grpo import SUPPORTED_LOSS_TYPES  # noqa: E402

EXACT = 1e-10


def train_and_audit(tmp_path, trainer_cls, **config):
    trainer, recorder, fake = build_trainer(trainer_cls, str(tmp_path / trainer_cls.__name__), **config)
    trainer.train()
    if trainer_cls is AccumGRPOTrainer and config.get("trainer_kwargs") is None:  # the default: fused log-probs
        assert trainer.fused_logprobs.forwards >= sum(len(u.micro_batches) for u in recorder.updates)
    if "max_steps" not in config:  # every generated completion trained exactly once: none dropped or repeated
        assert trained_rows(recorder) == fake.rows_generated
    return update_errors(trainer, recorder), [len(u.micro_batches) for u in recorder.updates], trainer


def mode_settings(loss_type: str) -> dict:
    if loss_type == "luspo":  # defined with GSPO's sequence-level ratio (TRL warns otherwise)
        return {"importance_sampling_level": "sequence"}
    if loss_type == "sapo":
        # Non-round temperatures (1.05 and 1.1 round in float32): TRL builds them as a float32 tensor; ours are in
        # the loss dtype, so the documented formula holds in float64 (test_sapo_temperatures_are_float64_exact).
        return {"sapo_temperature_pos": 1.1, "sapo_temperature_neg": 1.05}
    return {}


@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_every_loss_type_is_exact_with_kl(tmp_path, loss_type):
    errors, windows, _ = train_and_audit(tmp_path, AccumGRPOTrainer, loss_type=loss_type, beta=0.1,
                                         **mode_settings(loss_type))
    assert windows == [2] * 6
    assert max(errors) < EXACT, errors


def test_sapo_temperatures_are_float64_exact(tmp_path, monkeypatch):
    """Non-round temperatures (1.1, 1.05) against the documented formula in float64; the negative control runs
    TRL's float32 temperatures (our switch off): 1e-9-ish off."""
    settings = mode_settings("sapo")
    errors, _, _ = train_and_audit(tmp_path / "ours", AccumGRPOTrainer, loss_type="sapo", **settings)
    assert max(errors) < EXACT, errors
    monkeypatch.setattr(AccumGRPOTrainer, "_exact_sapo_temperatures", lambda self, model: contextlib.nullcontext())
    float32_errors, _, _ = train_and_audit(tmp_path / "float32", AccumGRPOTrainer, loss_type="sapo", **settings)
    print(f"sapo: ours {max(errors):.1e}, TRL's float32 temperatures {max(float32_errors):.1e}")
    assert max(float32_errors) > 1e-10, float32_errors


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_full_logits_path_is_exact_too(tmp_path, loss_type):
    """``fused_logprobs=False``: the float64 model's log-probs from its full logits (the fused path's control)."""
    errors, _, trainer = train_and_audit(tmp_path, AccumGRPOTrainer, loss_type=loss_type, beta=0.1, entropy_coef=0.05,
                                         trainer_kwargs={"fused_logprobs": False})
    assert trainer.fused_logprobs is None
    assert max(errors) < EXACT, errors


def test_short_last_window_spanning_generations(tmp_path):
    # 12 micro-batches in windows of 5, 5, 2; a generation every 3 micro-batches: each window spans 2-3 of them.
    errors, windows, _ = train_and_audit(tmp_path, AccumGRPOTrainer, loss_type="dapo", gradient_accumulation_steps=5)
    assert windows == [5, 5, 2]
    assert max(errors) < EXACT, errors


def test_generation_batch_longer_than_the_update(tmp_path):
    errors, windows, _ = train_and_audit(tmp_path, AccumGRPOTrainer, loss_type="bnpo", steps_per_generation=4)
    assert windows == [2] * 6
    assert max(errors) < EXACT, errors


def test_sequence_level_ratio_entropy_bonus_and_uncorrected_kl(tmp_path):
    errors, _, _ = train_and_audit(tmp_path, AccumGRPOTrainer, loss_type="grpo", beta=0.05, entropy_coef=0.05,
                                   importance_sampling_level="sequence", use_bias_correction_kl=False)
    assert max(errors) < EXACT, errors


def test_kl_metric_is_logged_per_update(tmp_path):
    _, _, trainer = train_and_audit(tmp_path, AccumGRPOTrainer, loss_type="dapo", beta=0.1, max_steps=2)
    kl = [log["kl"] for log in trainer.state.log_history if "kl" in log]
    assert len(kl) == 2 and all(value > 0 for value in kl)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_stock_trl_is_exact_where_micro_batches_hold_equal_sequences(tmp_path, loss_type):
    """The positive control: stock TRL's grpo / dr_grpo are exact here, so the reference computes TRL's formula."""
    errors, _, _ = train_and_audit(tmp_path, GRPOTrainer, loss_type=loss_type, beta=0.1)
    assert max(errors) < EXACT, errors


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_stock_trl_fails_the_same_check(tmp_path, loss_type):
    """The negative control (numbers in docs/grpo.md): dapo divides by the generation batch's average tokens per
    window (steps_per_generation != K), bnpo by each micro-batch's own tokens."""
    errors, _, _ = train_and_audit(tmp_path, GRPOTrainer, loss_type=loss_type)
    print(f"stock {loss_type}: update errors {[f'{e:.3f}' for e in errors]}")
    assert max(errors) > 1e-2, errors


@pytest.mark.parametrize("setting, message", [
    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
    ({"use_adaptive_entropy": True}, "use_adaptive_entropy=True"),
])
def test_settings_without_an_exact_rule_are_refused_before_loading(tmp_path, setting, message):
    from hf_accum.testing.grpo_reference import grpo_args, prompts_dataset, reward_len

    with pytest.raises(ValueError, match=message):
        AccumGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=reward_len,
                         args=grpo_args(str(tmp_path), **setting), train_dataset=prompts_dataset(4))


def test_unknown_loss_type_names_the_supported_ones():
    from hf_accum.trainer.grpo import refuse_inexact_settings

    class Args:
        loss_type = "aot"

    with pytest.raises(ValueError, match="supported .*grpo, sapo, luspo, dr_grpo, bnpo, dapo, cispo, vespo"):
        refuse_inexact_settings(Args())


def test_two_iterations_per_generation_with_evaluations_between_updates(tmp_path):
    """``num_iterations=2`` (each generation batch trained twice) and an evaluation every 2 updates (it leaves the
    model in eval mode before the next update's micro-batches are prepared)."""
    from hf_accum.testing.grpo_reference import prompts_dataset

    trainer, recorder, _ = build_trainer(AccumGRPOTrainer, str(tmp_path), loss_type="dapo", beta=0.1,
                                         num_iterations=2)
    trainer.eval_dataset = prompts_dataset(4)
    trainer.args.eval_strategy, trainer.args.eval_steps, trainer.args.per_device_eval_batch_size = "steps", 2, 2
    trainer.train()
    assert [log for log in trainer.state.log_history if "eval_loss" in log]
    rows = trained_rows(recorder)
    assert len(rows) == 24 and set(rows.values()) == {2}
    errors = update_errors(trainer, recorder)
    assert len(errors) == 12 and max(errors) < EXACT, errors
