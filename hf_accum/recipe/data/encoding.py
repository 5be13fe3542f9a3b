"""Encoding: token ids, and ``labels`` that are -100 wherever nothing is to be predicted.

Each example becomes ``{"input_ids", "labels"}`` (the Hugging Face convention, so the masking survives
``Trainer``'s ``remove_unused_columns`` and any collator). Examples longer than ``data.max_length``
are truncated and counted; one with no answer token left is dropped and counted.

It also owns where a turn ends (:func:`end_of_turn_id`, :func:`stop_token_ids`): the token the chat template
writes right after an assistant's content -- ``<|im_end|>`` (ChatML), ``<|eot_id|>`` (Llama 3),
``<end_of_turn>`` (Gemma), ``<|end|>`` (Phi-3), ``</s>`` (Mistral) -- is trained as the answer's last target,
and generation stops at it. What the template writes after it (ChatML's and Gemma's newline, Phi-3's
closing ``<|endoftext|>``) is a separator the model never has to produce: generation has stopped by then,
so it is not a target (as with TRL's ``assistant_only_loss``, whose ``{% generation %}`` blocks end there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from hf_accum.losses.token_loss import IGNORE_INDEX
from hf_accum.recipe.data.formats import Example
from hf_accum.recipe.data.reading import DataError

# Tokenizers are Any: transformers types their calls' results as unions (str, ids, BatchEncoding) that the
# arguments here decide.


def render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(ids)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the conversation up to (and including) the assistant header."""
    return render(tokenizer, messages, generation_prompt=True)


# A one-turn conversation whose answer is located in the rendered text (content unlikely to be merged with
# what follows it by any tokenizer: it ends on a plain letter).
_PROBE_ANSWER = "The answer is probe"


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The token the chat template writes right after an assistant's content, when it is a special token.

    Found by rendering a one-turn conversation as text and tokenizing what follows the answer: its first
    special (added) token. None when the template ends a turn with plain text only (the tokenizer's EOS
    is then the only stop)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": _PROBE_ANSWER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    at = text.rfind(_PROBE_ANSWER)
    if at < 0:
        return None
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)
    }
    tail = tokenizer(text[at + len(_PROBE_ANSWER):], add_special_tokens=False)["input_ids"]
    return next((i for i in tail if i in special), None)


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """Every id that ends an answer: the model's ``generation_config`` EOS id(s) (Llama 3 Instruct lists
    ``<|eot_id|>`` there beside ``<|end_of_text|>``), the tokenizer's EOS, and the chat template's
    end-of-turn token (:func:`end_of_turn_id`; Gemma's ``<end_of_turn>`` is not its EOS)."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    candidates += [tokenizer.eos_token_id, end_of_turn_id(tokenizer)]
    ids: list[int] = []
    for candidate in candidates:
        if candidate is not None and int(candidate) not in ids:
            ids.append(int(candidate))
    return ids


def cut_at_stop(ids: Sequence[int], stops: Iterable[int]) -> list[int]:
    """``ids`` up to (not including) the first stop id: the answer a generation gave."""
    stop_set = set(stops)
    return list(next((ids[:i] for i, token in enumerate(ids) if token in stop_set), ids))


def _trained_end(ids: Sequence[int], start: int, end: int, turn_end: int | None) -> int:
    """Where an answer's targets end: just after the last end-of-turn token in ``ids[start:end]`` (what the
    template writes after it is a separator, not produced by the model); ``end`` when it has none."""
    if turn_end is None:
        return end
    last = next((i for i in range(end - 1, start - 1, -1) if ids[i] == turn_end), None)
    return end if last is None else last + 1


def encode_conversation(
    tokenizer: Any, messages: Sequence[dict[str, str]], where: str = "", turn_end: int | None = None
) -> tuple[list[int], list[int], int]:
    """``(input_ids, labels, untrained)`` of a conversation ending with the assistant's answer.

    ``labels`` are the ids on every assistant message -- from after its header to the end of its
    turn, end-of-turn token included, the template's separator after it not (:func:`end_of_turn_id`) -- and
    -100 elsewhere. Each message is located by rendering
    the conversation up to it; an earlier assistant message that the template renders
    differently once later turns follow cannot be located, stays masked and is counted in
    ``untrained``. The last answer must be locatable (else the prompt would be trained on).
    ``turn_end``: the template's :func:`end_of_turn_id` (found once per split by the caller; None: the whole
    rendered turn is trained, separator included).
    """
    full = render(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(full)
    last, untrained = len(messages) - 1, 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = render(tokenizer, messages[:i], generation_prompt=True) if i else None
        end = full if i == last else render(tokenizer, messages[: i + 1])
        # The turn as rendered alone must match the full conversation up to its end-of-turn token; what the
        # template writes after it may differ (Phi-3 closes a conversation's last turn with EOS).
        stop = _trained_end(end, len(start), len(end), turn_end) if start is not None else 0
        if start is None or full[: len(start)] != start or full[:stop] != end[:stop] or stop <= len(start):
            if i == last:
                raise DataError(
                    f"{where or 'a row'}: the chat template renders the prompt differently with and without the "
                    "answer, so the answer's tokens cannot be located; set model.chat_template"
                )
            untrained += 1
            continue
        labels[len(start) : stop] = full[len(start) : stop]
    return full, labels, untrained


def encode_text(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
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


def encode_examples(tokenizer: Any, examples: Iterable[Example], max_length: int) -> EncodedSplit:
    """Encode, cut at ``max_length`` and count. An example whose answer was cut away entirely is
    dropped (counted): it would add no target, only compute."""
    split = EncodedSplit()
    turn_end = end_of_turn_id(tokenizer)
    for example in examples:
        if example.text is not None:
            ids, labels = encode_text(tokenizer, example.text)
        else:
            ids, labels, untrained = encode_conversation(tokenizer, example.conversation(), example.where, turn_end)
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
