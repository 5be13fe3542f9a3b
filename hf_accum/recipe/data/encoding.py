"""Encoding: token ids, and ``labels`` that are -100 wherever nothing is to be predicted.

Each example becomes ``{"input_ids", "labels"}`` (the Hugging Face convention, so the masking survives
``Trainer``'s ``remove_unused_columns`` and any collator). Examples longer than ``data.max_length``
are truncated and counted; one with no answer token left is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from hf_accum.loss import IGNORE_INDEX
from hf_accum.recipe.data.formats import Example
from hf_accum.recipe.data.reading import DataError


def render(tokenizer, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(ids)


def prompt_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the conversation up to (and including) the assistant header."""
    return render(tokenizer, messages, generation_prompt=True)


def encode_conversation(
    tokenizer, messages: Sequence[dict[str, str]], where: str = ""
) -> tuple[list[int], list[int], int]:
    """``(input_ids, labels, untrained)`` of a conversation ending with the assistant's answer.

    ``labels`` are the ids on every assistant message -- from after its header to the end of its
    turn, end-of-turn token included -- and -100 elsewhere. Each message is located by rendering
    the conversation up to it; an earlier assistant message that the template renders
    differently once later turns follow cannot be located, stays masked and is counted in
    ``untrained``. The last answer must be locatable (else the prompt would be trained on).
    """
    full = render(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(full)
    last, untrained = len(messages) - 1, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(tokenizer, messages[:i], generation_prompt=True) if i else None
        end = full if i == last else render(tokenizer, messages[: i + 1])
        if start is None or full[: len(start)] != start or full[: len(end)] != end or len(end) <= len(start):
            if i == last:
                raise DataError(
                    f"{where or 'a row'}: the chat template renders the prompt differently with and without the "
                    "answer, so the answer's tokens cannot be located; set model.chat_template"
                )
            untrained += 1
            continue
        labels[len(start) : len(end)] = full[len(start) : len(end)]
    return full, labels, untrained


def encode_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of plain text: every token is a target (end-of-sequence appended)."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    return ids, list(ids)


@dataclass
class EncodedSplit:
    """Encoded examples ``{"input_ids", "labels"}`` and what encoding them did."""

    examples: list[dict[str, list[int]]] = field(default_factory=list)
    truncated: int = 0
    """Examples longer than ``max_length``, cut to it."""
    dropped: int = 0
    """Examples left without any target by the cut (skipped: they would add no loss)."""
    longest_prompt: int = 0
    """Most tokens before the first target, over every example (the ``max_length`` that keeps all)."""
    untrained_turns: int = 0
    tokens: int = 0
    targets: int = 0
    unknown: int = 0
    """``<unk>`` tokens in the kept examples."""

    def summary(self) -> str:
        return (
            f"{len(self.examples)} examples, {self.tokens} tokens, {self.targets} targets "
            f"({self.truncated} truncated, {self.dropped} dropped: no answer token left)"
        )


def encode_examples(tokenizer, examples: Iterable[Example], max_length: int) -> EncodedSplit:
    """Encode, cut at ``max_length`` and count. An example whose answer was cut away entirely is
    dropped (counted): it would add no target, only compute."""
    split = EncodedSplit()
    for example in examples:
        if example.text is not None:
            ids, labels = encode_text(tokenizer, example.text)
        else:
            ids, labels, untrained = encode_conversation(tokenizer, example.messages, example.where)
            split.untrained_turns += untrained
        # Position 0 is never a target (nothing precedes it): the prompt ends where targets begin.
        prompt = next((i for i, label in enumerate(labels) if i > 0 and label != IGNORE_INDEX), len(labels))
        split.longest_prompt = max(split.longest_prompt, prompt)
        split.truncated += len(ids) > max_length
        ids, labels = ids[:max_length], labels[:max_length]
        targets = sum(label != IGNORE_INDEX for label in labels[1:])
        if not targets:
            split.dropped += 1
            continue
        split.examples.append({"input_ids": ids, "labels": labels})
        split.tokens += len(ids)
        split.targets += targets
        if tokenizer.unk_token_id is not None:
            split.unknown += ids.count(tokenizer.unk_token_id)
    return split
