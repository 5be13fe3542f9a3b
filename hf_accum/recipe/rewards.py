"""GRPO's rewards in the recipe: the built-in verifiable rewards and the user's own functions named by import path
(``grpo.reward_funcs: [exact_match, mypkg.rewards:fn]``), resolved and checked before any model loads.

A reward function is called as TRL calls one: ``fn(prompts=..., completions=..., completion_ids=..., **kwargs)``
returning one float (or None) per completion. ``kwargs`` carry the dataset's other columns -- here ``answer`` (the
reference answer, as the tokenizer gives it back) and ``task`` -- and TRL's own (``trainer_state``, ...). A
completion is a string, or for conversational prompts a list of one assistant message.

Built-in (:data:`BUILT_IN`): ``exact_match`` -- 1 when the completion equals the reference answer after whitespace
normalisation (the held-out metric's rule, :func:`hf_accum.recipe.data.metric.normalize_answer`), else 0;
``word_accuracy`` -- the fraction of word positions where the completion holds the reference's word, over the longer
of the two (partial credit: a group whose completions all miss the exact answer still ranks them, and an extra or a
missing word costs its position); ``format`` -- 1 when the stripped completion fully matches ``grpo.format_pattern``,
else 0.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable, Sequence

from hf_accum.errors import InputError
from hf_accum.recipe.data.metric import normalize_answer

RewardFunction = Callable[..., Any]


class RewardError(InputError):
    """A ``grpo.reward_funcs`` entry that cannot be used (exit 2, before any model loads)."""


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the content of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion if isinstance(message, dict))
    return str(completion)


def exact_match(completions: Sequence[Any], answer: Sequence[str] | None = None, **kwargs: Any) -> list[float]:
    """1.0 where the completion equals its reference ``answer`` (whitespace-normalised), else 0.0."""
    if answer is None:
        raise ValueError("the exact_match reward needs each prompt's reference answer (an 'answer' column)")
    return [float(normalize_answer(completion_text(c)) == normalize_answer(a)) for c, a in zip(completions, answer)]


def word_accuracy(completions: Sequence[Any], answer: Sequence[str] | None = None, **kwargs: Any) -> list[float]:
    """Per completion: the words equal to the reference's at the same position, over the longer word count (1.0
    exactly where :func:`exact_match` is 1; an empty completion of an empty answer is 1.0)."""
    if answer is None:
        raise ValueError("the word_accuracy reward needs each prompt's reference answer (an 'answer' column)")
    scores = []
    for completion, reference in zip(completions, answer):
        got, want = completion_text(completion).split(), reference.split()
        longest = max(len(got), len(want))
        scores.append(sum(g == w for g, w in zip(got, want)) / longest if longest else 1.0)
    return scores


def format_reward(pattern: str) -> RewardFunction:
    """The ``format`` reward: 1.0 where the stripped completion fully matches ``pattern``, else 0.0."""
    compiled = re.compile(pattern)

    def format_check(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return [float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions]

    format_check.__name__ = "format"  # TRL logs a reward by its function's name: rewards/format/mean
    return format_check


BUILT_IN = ("exact_match", "word_accuracy", "format")
NEEDS_ANSWER = ("exact_match", "word_accuracy")


def check_pattern(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as error:
        raise RewardError(f"grpo.format_pattern={pattern!r}: not a regular expression ({error})") from None


def resolve_reward(spec: str, format_pattern: str = r"\S[^\n]*") -> RewardFunction:
    """The function ``spec`` names: a built-in name or ``module:function``; refused (one line) when it cannot be
    imported, is not callable, or cannot be called as TRL calls a reward function."""
    if spec == "exact_match":
        return exact_match
    if spec == "word_accuracy":
        return word_accuracy
    if spec == "format":
        check_pattern(format_pattern)
        return format_reward(format_pattern)
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise RewardError(f"grpo.reward_funcs: {spec!r} is neither a built-in reward ({', '.join(BUILT_IN)}) nor an "
                          "import path 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module's own failure at import
        raise RewardError(f"grpo.reward_funcs: {spec!r}: cannot import {module_name!r} "
                          f"({type(error).__name__}: {error})") from None
    function = module
    for part in attribute.split("."):
        if not hasattr(function, part):
            raise RewardError(f"grpo.reward_funcs: {spec!r}: module {module_name!r} has no {attribute!r}")
        function = getattr(function, part)
    check_signature(spec, function)
    return function  # type: ignore[return-value]  # checked callable with TRL's call


def check_signature(spec: str, function: Any) -> None:
    """``function`` must accept TRL's call: ``prompts``, ``completions``, ``completion_ids`` and any other keyword
    (``**kwargs``: the dataset's columns and TRL's own)."""
    if not callable(function):
        raise RewardError(f"grpo.reward_funcs: {spec!r} is a {type(function).__name__}, not a function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: TRL's call decides
    try:
        signature.bind(prompts=[], completions=[], completion_ids=[], answer=[], trainer_state=None)
    except TypeError as error:
        raise RewardError(
            f"grpo.reward_funcs: {spec!r} has the signature {signature}, which TRL cannot call ({error}); a reward "
            "function takes (prompts, completions, completion_ids, **kwargs) and returns one float per completion"
        ) from None


def resolve_rewards(specs: Sequence[str], format_pattern: str = r"\S[^\n]*") -> list[RewardFunction]:
    """Every reward of ``grpo.reward_funcs``, in order (at least one)."""
    if not specs:
        raise RewardError(f"grpo.reward_funcs is empty; allowed: a list of {', '.join(BUILT_IN)} or "
                          "'package.module:function' import paths")
    if len(set(specs)) != len(specs):
        raise RewardError(f"grpo.reward_funcs={list(specs)} names a reward twice (weights: grpo.reward_weights)")
    return [resolve_reward(spec, format_pattern) for spec in specs]


def reward_name(spec: str) -> str:
    """The name TRL logs a reward under (``rewards/<name>/mean``): the function's name."""
    return spec.rpartition(":")[2].rpartition(".")[2] if ":" in spec else spec
