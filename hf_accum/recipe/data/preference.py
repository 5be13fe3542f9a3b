"""Preference data for DPO: rows with a prompt, a chosen and a rejected answer -> encoded pairs.

The recipe calls :func:`load_preference_data` ``(model_section, data_section)`` instead of
:func:`hf_accum.recipe.data.load_tokenizer_and_data` when ``objective: dpo``; everything is read,
checked and encoded before any model is loaded, as for SFT.

* **Formats** (:data:`~hf_accum.recipe.data.formats.PREFERENCE_FORMATS`, TRL's): ``preference`` --
  ``prompt`` + ``chosen`` + ``rejected``, each a string or a list of messages (the prompt a conversation
  not ending with the assistant, each answer one assistant message); ``preference_implicit`` --
  ``chosen`` + ``rejected`` only, two conversations sharing every message but their last answer. A row
  that fits neither is refused with its row number (:func:`~hf_accum.recipe.data.formats.to_examples`).
* **Encoding** (:func:`encode_pair`), as TRL tokenizes a conversational pair: the prompt rendered with
  the chat template up to the assistant header (``add_generation_prompt``), each answer as the assistant
  turn after it. A pair is ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (TRL's tokenized columns);
  :func:`labelled` gives a side's ``(input_ids, labels)``, labels -100 on the prompt and the answer's ids
  from after the header to the end of its turn, end-of-turn token included (as for SFT). A pair longer
  than ``data.max_length`` keeps its start (TRL's ``keep_start``) and is counted; one whose prompt leaves
  no answer token is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from hf_accum.losses.token_loss import IGNORE_INDEX
from hf_accum.recipe import modeling
from hf_accum.recipe.data.encoding import prompt_ids, render
from hf_accum.recipe.data.formats import PREFERENCE_FORMATS, Example
from hf_accum.recipe.data.reading import DataError
from hf_accum.recipe.data.splits import load_splits
from hf_accum.recipe.embedded import EMBEDDED_DATASET, TINY_MODEL

SIDES = ("chosen", "rejected")


def encode_answer(tokenizer: Any, prompt: Sequence[dict[str, str]], answer: dict[str, str],
                  where: str = "") -> list[int]:
    """The ids of ``answer`` as the assistant turn after ``prompt``: from after the assistant header to the end
    of the turn (end-of-turn token included). The template must render the prompt as a prefix of the whole
    conversation (else the answer's tokens cannot be located)."""
    start = prompt_ids(tokenizer, prompt)
    full = render(tokenizer, [*prompt, answer])
    if full[: len(start)] != start or len(full) <= len(start):
        raise DataError(
            f"{where or 'a row'}: the chat template renders the prompt differently with and without the answer, so "
            "the answer's tokens cannot be located; set model.chat_template"
        )
    return full[len(start):]


def encode_pair(tokenizer: Any, example: Example) -> dict[str, list[int]]:
    """``{"prompt_ids", "chosen_ids", "rejected_ids"}`` of a preference :class:`Example` (uncut)."""
    prompt = example.conversation()[:-1]
    assert example.rejected is not None  # a preference format's example
    return {
        "prompt_ids": prompt_ids(tokenizer, prompt),
        "chosen_ids": encode_answer(tokenizer, prompt, example.conversation()[-1], example.where),
        "rejected_ids": encode_answer(tokenizer, prompt, example.rejected, example.where),
    }


def labelled(pair: dict[str, Any], side: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one side of an encoded pair: the prompt then the answer; labels -100 on the
    prompt, the answer's ids on the answer."""
    prompt, answer = list(pair["prompt_ids"]), list(pair[f"{side}_ids"])
    return prompt + answer, [IGNORE_INDEX] * len(prompt) + answer


def cut_pair(pair: dict[str, list[int]], max_length: int) -> dict[str, list[int]] | None:
    """The pair with each side cut to ``max_length`` tokens from its start (TRL's ``keep_start``), or None when
    the prompt leaves no answer token (a target needs a position after the first)."""
    prompt = pair["prompt_ids"]
    if len(prompt) >= max_length:
        return None
    room = max_length - len(prompt)
    return {"prompt_ids": prompt, **{f"{side}_ids": pair[f"{side}_ids"][:room] for side in SIDES}}


@dataclass
class PreferenceSplit:
    """Encoded pairs (with the examples they came from, for TRL's trainer and the per-task score) and what
    encoding them did. Its counters mirror :class:`~hf_accum.recipe.data.encoding.EncodedSplit`'s."""

    examples: list[dict[str, list[int]]] = field(default_factory=list)
    sources: list[Example] = field(default_factory=list)
    """The :class:`Example` of each kept pair, in the same order."""
    truncated: int = 0
    """Pairs with a side longer than ``max_length``, cut to it."""
    dropped: int = 0
    """Pairs whose prompt alone fills ``max_length`` (skipped: no answer token left)."""
    longest_prompt: int = 0
    tokens: int = 0
    targets: int = 0
    """Answer tokens over both sides (the targets of the ``sft`` term count only the chosen ones)."""
    unknown: int = 0

    def summary(self) -> str:
        return (f"{len(self.examples)} pairs, {self.tokens} tokens, {self.targets} answer tokens "
                f"({self.truncated} truncated, {self.dropped} dropped: no answer token left)")

    def as_conversations(self) -> list[dict[str, Any]]:
        """TRL's conversational preference rows of the kept pairs (what ``DPOTrainer`` tokenizes itself)."""
        return [{"prompt": example.conversation()[:-1], "chosen": [example.conversation()[-1]],
                 "rejected": [example.rejected]}
                for example in self.sources]


def encode_pairs(tokenizer: Any, examples: Iterable[Example], max_length: int) -> PreferenceSplit:
    """Encode, cut at ``max_length`` and count every preference example."""
    split = PreferenceSplit()
    for example in examples:
        whole = encode_pair(tokenizer, example)
        split.longest_prompt = max(split.longest_prompt, len(whole["prompt_ids"]))
        pair = cut_pair(whole, max_length)
        if pair is None:
            split.dropped += 1
            continue
        split.truncated += any(pair[f"{side}_ids"] != whole[f"{side}_ids"] for side in SIDES)
        split.examples.append(pair)
        split.sources.append(example)
        ids = [pair["prompt_ids"] + pair[f"{side}_ids"] for side in SIDES]
        split.tokens += sum(map(len, ids))
        split.targets += sum(len(pair[f"{side}_ids"]) for side in SIDES)
        if tokenizer.unk_token_id is not None:
            split.unknown += sum(row.count(tokenizer.unk_token_id) for row in ids)
    return split


@dataclass
class PreferenceData:
    """Everything a DPO run trains and scores on (the shape of :class:`hf_accum.recipe.data.RecipeData`)."""

    train: PreferenceSplit
    held_out: PreferenceSplit | None
    """Held-out pairs, scored by the pairwise accuracy; None when there are none."""
    format: str
    report: list[str]

    @property
    def eval_rows(self) -> list[Example]:
        return self.held_out.sources if self.held_out else []


def load_preference_data(model: Any, data: Any) -> tuple[Any, PreferenceData]:
    """The tokenizer and the encoded preference pairs of a DPO run, from its ``model`` and ``data`` sections.

    Problems raise :class:`DataError` (one line) before any model is loaded. With ``hf_accum:tiny-llama``
    and the user's own data, the word-level vocabulary is built from it (prompts and both answers)."""
    splits = load_splits(data, formats=PREFERENCE_FORMATS)
    corpus = None
    if model.name_or_path == TINY_MODEL and data.dataset != EMBEDDED_DATASET:
        corpus = [text for example in (*splits.train, *splits.held_out) for text in example.texts()]
    source = model.tokenizer or model.name_or_path
    tokenizer = modeling.load_tokenizer(source, model.chat_template, model.trust_remote_code, corpus=corpus)
    train = encode_pairs(tokenizer, splits.train, data.max_length)
    if not train.examples:
        raise DataError(
            f"data.max_length={data.max_length} leaves no answer token in any of the {train.dropped} training pairs "
            f"(the longest prompt is {train.longest_prompt} tokens); raise data.max_length above {train.longest_prompt}"
        )
    held_out = encode_pairs(tokenizer, splits.held_out, data.max_length) if splits.held_out else None
    report = [*splits.report, f"train: {train.summary()}"]
    if train.dropped:
        report.append(f"note: {train.dropped} training pairs had no answer token within data.max_length="
                      f"{data.max_length} (longest prompt: {train.longest_prompt} tokens) and are skipped")
    if held_out is not None and held_out.dropped:
        report.append(f"note: {held_out.dropped} held-out pairs have no answer token within data.max_length")
    unknown = sum(split.unknown for split in (train, held_out) if split is not None)
    if unknown:
        report.append(f"note: {unknown} tokens of the pairs are {tokenizer.unk_token} for this tokenizer")
    return tokenizer, PreferenceData(train, held_out, splits.format.name, report)
