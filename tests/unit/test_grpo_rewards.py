"""The recipe's GRPO rewards (hf_accum.recipe.rewards): the built-ins' values, and a reward named by import path
resolved or refused (one line) before any model loads."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from hf_accum.errors import InputError
from hf_accum.recipe.rewards import exact_match, resolve_reward, resolve_rewards


def test_exact_match_compares_whitespace_normalised_text_and_chat_completions():
    completions = ["a  b", [{"role": "assistant", "content": " a b\n"}], "a c"]
    assert exact_match(completions, answer=["a b", "a b", "a b"]) == [1.0, 1.0, 0.0]


def test_format_reward_is_a_full_match_of_the_pattern():
    fmt = resolve_reward("format", r"\w+")
    assert fmt.__name__ == "format"
    assert fmt(["word", "two words", ""]) == [1.0, 0.0, 0.0]


def test_a_function_by_import_path_is_resolved():
    assert resolve_reward("hf_accum.recipe.rewards:exact_match") is exact_match


@pytest.mark.parametrize("spec, message", [
    ("nopkg.rewards:fn", "cannot import 'nopkg.rewards'"),
    ("hf_accum.recipe.rewards:missing", "has no 'missing'"),
    ("hf_accum.recipe.rewards:BUILT_IN", "not a function"),
    ("hf_accum.recipe.rewards:completion_text", "which TRL cannot call"),
    ("no_colon", "neither a built-in reward"),
])
def test_bad_reward_is_one_line(spec, message):
    with pytest.raises(InputError, match=message) as caught:
        resolve_rewards([spec])
    assert "\n" not in str(caught.value)


def test_empty_or_repeated_rewards_are_refused():
    with pytest.raises(InputError, match="empty"):
        resolve_rewards([])
    with pytest.raises(InputError, match="twice"):
        resolve_rewards(["exact_match", "exact_match"])


def test_the_sections_loss_types_are_the_ones_accum_grpo_trainer_makes_exact():
    from hf_accum.recipe.grpo_section import LOSS_TYPES
    from hf_accum.trainer.grpo import SUPPORTED_LOSS_TYPES

    assert set(LOSS_TYPES) == set(SUPPORTED_LOSS_TYPES)


def _resolved_grpo(argv, tmp_path):
    from hf_accum.recipe import checks
    from hf_accum.recipe import config as recipe_config

    path, overrides = recipe_config.parse_overrides(["objective=grpo", f"training.output_dir={tmp_path}", *argv])
    return checks.resolve(recipe_config.load_config(path, overrides), ("loop", "trainer"), ("sft", "dpo", "grpo"))


def test_the_embedded_grpo_default_passes_its_checks(tmp_path):
    config = _resolved_grpo([], tmp_path)
    assert config.objective == "grpo" and config.engine == "trainer"


@pytest.mark.parametrize("override, named", [
    ("accumulation.peak_flops=1e12", "accumulation.peak_flops=1000000000000.0"),
    ("accumulation.stop_on_signals=false", "accumulation.stop_on_signals=False"),
    ("accumulation.normalization=sequence", "accumulation.normalization='sequence'"),
])
def test_an_accumulation_setting_grpo_would_not_apply_is_refused_by_name(override, named, tmp_path):
    """AccumGRPOTrainer takes only fused_loss of the accumulation section: any other setting changed from its
    default would be silently ignored by the GRPO stage, so it is refused before loading, named."""
    from hf_accum.recipe.config import ConfigError

    with pytest.raises((InputError, ConfigError), match=re.escape(named)):
        _resolved_grpo([override], tmp_path)
    assert _resolved_grpo(["accumulation.fused_loss=false"], tmp_path).accumulation.fused_loss is False


def test_a_kl_reference_with_a_starting_adapter_is_refused(tmp_path):
    from hf_accum.recipe.config import ConfigError

    seed = _resolved_grpo([], tmp_path).training.seed
    run = tmp_path / "dpo_run"  # a finished run's directory as the recipe writes it
    (run / "adapter").mkdir(parents=True)
    (run / "resolved_config.yaml").write_text(yaml.safe_dump(
        {"model": {"name_or_path": "hf_accum:tiny-llama", "config_overrides": {}}, "training": {"seed": seed}}))
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"base_model_name_or_path": None, "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    assert _resolved_grpo([f"model.adapter={run}"], tmp_path).model.adapter == str(run)  # beta 0: accepted
    with pytest.raises((InputError, ConfigError), match="grpo.beta=0.1 with model.adapter"):
        _resolved_grpo(["grpo.beta=0.1", f"model.adapter={run}"], tmp_path)


def test_word_accuracy_credits_each_right_word_in_place_over_the_longer_count():
    from hf_accum.recipe.rewards import word_accuracy

    answer = ["red green blue"] * 5
    completions = ["red green blue", "red blue green", "red green", "red green blue blue", [
        {"role": "assistant", "content": " red  green blue\n"}]]
    assert word_accuracy(completions, answer=answer) == [1.0, pytest.approx(1 / 3), pytest.approx(2 / 3), 0.75, 1.0]
    assert word_accuracy(["", "x"], answer=["", ""]) == [1.0, 0.0]
    assert resolve_reward("word_accuracy") is word_accuracy
    with pytest.raises(ValueError, match="reference answer"):
        word_accuracy(["a"])


def test_word_accuracy_is_one_exactly_where_exact_match_is():
    from hf_accum.recipe.rewards import word_accuracy

    completions = ["a b", "a  b ", "b a", "a", "a b c", ""]
    answer = ["a b"] * len(completions)
    assert [w == 1.0 for w in word_accuracy(completions, answer=answer)] == [
        e == 1.0 for e in exact_match(completions, answer=answer)]


def test_the_grpo_stage_per_task_line_pairs_each_task_before_and_after():
    from hf_accum.recipe.grpo import per_task_line

    before = {"exact_match": 0.4, "per_task": {"copy": 0.32, "last": 1.0}}
    after = {"exact_match": 0.5, "per_task": {"copy": 0.4, "last": 1.0}}
    assert per_task_line(before, after) == "GRPO stage per task: copy 32% -> 40%, last 100% -> 100%"
    assert per_task_line(None, after) is None


def test_train_modules_to_save_false_leaves_only_the_lora_matrices_trainable(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from hf_accum.recipe.grpo import freeze_modules_to_save
    from hf_accum.tiny import tiny_llama_config

    assert _resolved_grpo(["grpo.train_modules_to_save=false"], tmp_path).grpo.train_modules_to_save is False
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(tiny_llama_config(vocab_size=32)), LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".modules_to_save." in name for name in trainable)  # the negative control: trained in full before
    freeze_modules_to_save(model)
    left = {name for name, p in model.named_parameters() if p.requires_grad}
    assert left and all("lora_" in name for name in left)
    assert left == {name for name in trainable if ".modules_to_save." not in name}


def test_the_warm_start_batch_is_whole_micro_batches(tmp_path):
    from hf_accum.recipe.config import ConfigError

    assert _resolved_grpo(["grpo.warm_start_batch_size=32"], tmp_path).grpo.warm_start_batch_size == 32
    with pytest.raises((InputError, ConfigError), match="grpo.warm_start_batch_size=12 must be a positive multiple"):
        _resolved_grpo(["grpo.warm_start_batch_size=12"], tmp_path)
