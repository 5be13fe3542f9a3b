"""Tiny supervised fine-tuning data in TRL's dataset formats, for audited ``SFTTrainer`` runs.

A word-level tokenizer (:func:`hf_accum.tiny.build_tiny_tokenizer`) over the words ``w0 ..
w39``, whose chat template marks the assistant's turns with ``{% generation %}`` (TRL's
``assistant_only_loss`` reads those marks), a float64 tiny Llama of that vocabulary, and random
rows of strongly uneven length as a ``datasets.Dataset`` in one of TRL's formats. Kept apart from
the rest of :mod:`hf_accum.testing` because it needs ``datasets`` rows shaped for TRL.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import torch
from datasets import Dataset
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hf_accum.testing.models import tiny_causal_lm
from hf_accum.tiny import build_tiny_tokenizer

WORDS = [f"w{i}" for i in range(40)]
# Like the recipe's template; the assistant's content and its end-of-turn token are generation marks.
TRAINING_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FORMATS = ("prompt_completion", "conversational_prompt_completion", "messages", "text")


def sft_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over :data:`WORDS` with :data:`TRAINING_CHAT_TEMPLATE`; ``<|end|>`` is EOS."""
    tokenizer = build_tiny_tokenizer(WORDS)
    tokenizer.chat_template = TRAINING_CHAT_TEMPLATE
    return tokenizer


def sft_model_factory(tokenizer: PreTrainedTokenizerBase,
                      dtype: torch.dtype = torch.float64) -> Callable[[], LlamaForCausalLM]:
    """Builds the float64 tiny Llama (dtype-keeping norms) over ``tokenizer``'s vocabulary, seed 0."""
    return lambda: tiny_causal_lm(
        dtype=dtype, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )


def sft_rows(
    n: int,
    data_format: str = "prompt_completion",
    seed: int = 0,
    prompt_words: tuple[int, int] = (1, 14),
    answer_words: tuple[int, int] = (1, 8),
    long_rows: Callable[[int], bool] | None = None,
) -> Dataset:
    """``n`` rows in a TRL format (:data:`FORMATS`); prompt and answer lengths uniform in the given
    ranges of words; ``long_rows(i)`` forces row ``i`` to the longest prompt and answer (True) or the
    shortest (False), to give DDP ranks very different token counts.

    Plain-text completions start with a space: TRL tokenizes prompt + completion as one string.
    """
    if data_format not in FORMATS:
        raise ValueError(f"data_format={data_format!r}; allowed: {FORMATS}")
    rng = random.Random(seed)

    def words(i: int, bounds: tuple[int, int]) -> str:
        count = rng.randint(*bounds) if long_rows is None else bounds[1] if long_rows(i) else bounds[0]
        return " ".join(rng.choice(WORDS) for _ in range(count))

    rows: list[dict[str, Any]] = []
    for i in range(n):
        prompt, answer = words(i, prompt_words), words(i, answer_words)
        if data_format == "prompt_completion":
            rows.append({"prompt": prompt, "completion": " " + answer})
        elif data_format == "conversational_prompt_completion":
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "completion": [{"role": "assistant", "content": answer}]})
        elif data_format == "messages":
            rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
        else:
            rows.append({"text": prompt + " " + answer})
    return Dataset.from_list(rows)


def answer_targets(rows: Dataset, tokenizer: Any) -> int:  # Any: the call's result type is a union
    """Tokens the loss should be on with completion-only / assistant-only loss: every answer's words
    plus its end-of-turn (EOS) token, counted from the raw rows (not from TRL's preparation)."""
    return sum(len(tokenizer(_answer(row), add_special_tokens=False)["input_ids"]) + 1 for row in rows)


def _answer(row: dict) -> str:
    if "messages" in row:
        return row["messages"][-1]["content"]
    completion = row["completion"]
    return completion[-1]["content"] if isinstance(completion, list) else completion
