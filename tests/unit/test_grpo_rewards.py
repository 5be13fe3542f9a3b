"""The recipe's GRPO rewards (hf_accum.recipe.rewards): the built-ins' values, and a reward named by import path
resolved or refused (one line) before any model loads."""

from __future__ import annotations

import pytest

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
