"""One declaration per accumulation setting (:mod:`hf_accum.settings`): every field of ``AccumulationSettings`` is a
``LoopConfig`` keyword and attribute, an ``AccumTrainer`` keyword and a recipe key, with no second declaration;
each front-end names a bad value in its own terms, and the recipe's section object reaches the loop uncopied."""

from __future__ import annotations

import dataclasses

import pytest

from hf_accum import AccumulationSettings, LoopConfig
from hf_accum.loop import LoopConfigError
from hf_accum.recipe.config import ConfigError, build_config, valid_keys
from hf_accum.settings import AccumulationSettingsError

SETTINGS = [f.name for f in dataclasses.fields(AccumulationSettings)]
# A valid non-default value of every setting: each one must travel (a default would pass by accident).
CHANGED = {"loss_kind": "causal_lm", "fused_loss": False, "fp32_grad_accumulation": False,
           "normalization": "sequence", "rampup_batch_size": [8, 8, 800], "rampup_auto": None,
           "tokens_per_update": None, "noise_scale": True, "noise_scale_micro_batches": "first", "peak_flops": 1e12,
           "max_consecutive_nonfinite": 3, "stop_on_signals": False}


def test_the_changed_values_cover_every_setting():
    assert sorted(CHANGED) == sorted(SETTINGS)


def test_every_setting_is_declared_once_and_reaches_every_front_end():
    loop = LoopConfig(**CHANGED)
    section = build_config({"accumulation": CHANGED}).accumulation
    for name in SETTINGS:
        assert name not in {f.name for f in dataclasses.fields(LoopConfig)}, f"LoopConfig declares {name} again"
        assert name in valid_keys("accumulation")
        assert getattr(loop, name) == getattr(loop.accumulation, name) == CHANGED[name]
        assert getattr(section, name) == CHANGED[name]
    assert type(section) is AccumulationSettings and loop.accumulation == section
    flat = {**CHANGED, "model": None}
    assert AccumulationSettings.adapt(None, flat, "AccumTrainer({})") == section and flat == {"model": None}


def test_the_recipe_section_object_itself_reaches_the_loop():
    from transformers import TrainingArguments

    section = build_config({"accumulation": {"noise_scale": True, "peak_flops": 5e12}}).accumulation
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    config = LoopConfig.from_training_arguments(args, accumulation=section)
    assert config.accumulation is section and config.peak_flops == 5e12 and config.noise_scale is True


@pytest.mark.parametrize("build, error, message", [
    (lambda: AccumulationSettings(peak_flops=-1), AccumulationSettingsError, "accumulation.peak_flops=-1 must be"),
    (lambda: LoopConfig(peak_flops=-1), LoopConfigError, "LoopConfig.peak_flops=-1 must be"),
    (lambda: AccumulationSettings.adapt(None, {"peak_flops": -1}, "AccumTrainer({})"), ValueError,
     r"AccumTrainer\(peak_flops\)=-1 must be"),
    (lambda: build_config({"accumulation": {"peak_flops": -1}}), ConfigError,  # float by pydantic
     r"accumulation.peak_flops=-1\.0 must be"),
    (lambda: LoopConfig(noise_scale_micro_batches="all"), LoopConfigError,
     "LoopConfig.noise_scale_micro_batches='all'; allowed: every, first"),
    (lambda: AccumulationSettings(tokens_per_update=64, normalization="sequence"), AccumulationSettingsError,
     "accumulation.tokens_per_update with normalization='sequence'"),
    (lambda: AccumulationSettings(max_consecutive_nonfinite=0), AccumulationSettingsError,
     "accumulation.max_consecutive_nonfinite=0 must be an integer >= 1"),
    (lambda: LoopConfig(accumulation=AccumulationSettings(), noise_scale=True), LoopConfigError,
     "LoopConfig.noise_scale given beside LoopConfig.accumulation"),
])
def test_each_front_end_names_a_bad_value_in_its_own_terms(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_a_flat_write_lands_in_the_held_settings_and_is_checked():
    config = LoopConfig()
    config.peak_flops = -2.0
    assert config.accumulation.peak_flops == -2.0
    with pytest.raises(LoopConfigError, match="LoopConfig.peak_flops=-2.0"):
        config.validate()
    with pytest.raises(AttributeError, match="no attribute 'peak_flop'"):
        _ = config.peak_flop
    with pytest.raises(TypeError, match="unexpected keyword argument 'peak_flop'"):
        LoopConfig(peak_flop=1e12)


def test_the_auto_ramp_turns_the_noise_scale_on_and_keeps_its_mapping():
    settings = AccumulationSettings(rampup_batch_size="auto", rampup_auto={"lr_rule": "sqrt"})
    assert settings.noise_scale is True and settings.rampup_auto == {"lr_rule": "sqrt"} and settings.auto_ramp


def test_settings_changed_after_they_were_built_are_checked_again_where_they_are_taken():
    settings = AccumulationSettings()
    settings.peak_flops = -3.0
    with pytest.raises(ValueError, match=r"AccumTrainer\(accumulation\)\.peak_flops=-3\.0 must be"):
        AccumulationSettings.adapt(settings, {}, "AccumTrainer({})")
    with pytest.raises(LoopConfigError, match=r"LoopConfig\.accumulation\.peak_flops=-3\.0 must be"):
        LoopConfig(accumulation=settings)
