"""The recipe's data: the user's own rows in every common format, held-out splits, bad-row checks,
prompt masking with ``labels``, and the exact-match metric.

The recipe calls one function, :func:`load_tokenizer_and_data` ``(model_section, data_section)``,
which reads, checks, splits and encodes everything before any model is loaded. What it does:

* **Reading.** Local ``.jsonl`` and ``.json`` files are read here, line by line, so that a malformed
  line or invalid UTF-8 is reported with its line number; ``.parquet``, ``.csv`` and ``datasets``
  hub names are read through ``datasets``, ``save_to_disk`` directories with ``load_from_disk``; a URL is
  refused with what is supported. ``hf_accum:synthetic-tasks`` is generated in-process.
* **Formats**, detected from the columns (first match in this order) or forced with ``data.format``:

  ===================  =============================================  ================================
  format               columns                                        trained on
  ===================  =============================================  ================================
  chat                 ``messages`` (``role``/``content``) or        every assistant message
                       ``conversations`` (ShareGPT from/value)
  prompt_completion    ``prompt`` (or ``question``) + ``completion``  the completion
                       (or ``answer``)
  alpaca               ``instruction`` + ``output``, opt. ``input``   the output
  text                 ``text``                                       every token
  ===================  =============================================  ================================

  The non-text formats become a conversation rendered with the model's chat template (alpaca's
  ``input`` is joined into the user message). ``data.<role>_column`` renames a column.
* **Preference pairs** (``objective: dpo``): ``prompt`` + ``chosen`` + ``rejected`` (strings or messages), or
  ``chosen`` + ``rejected`` conversations sharing their prompt; read, checked and encoded by
  :mod:`hf_accum.recipe.data.preference` (:func:`~hf_accum.recipe.data.preference.load_preference_data`).
* **Splits.** The held-out rows (the exact-match metric) come from ``data.eval_split`` -- a split
  or slice of the same dataset, or a second local file -- or, when it is unset, are carved at
  random from the training rows (``data.eval_fraction``, capped at ``data.max_eval_examples``,
  seeded). Either way no held-out row is trained on.
* **Bad rows** (no answer, no prompt, malformed conversations) refuse the whole run with their
  count and the first one's line; nothing is silently dropped or stringified.
* **Encoding.** Each example is ``{"input_ids", "labels"}`` with ``labels`` -100 wherever nothing is
  to be predicted (the Hugging Face convention), so the masking survives ``Trainer``'s
  ``remove_unused_columns`` and any collator. Examples longer than ``data.max_length`` are
  truncated and counted; one with no answer token left is dropped and counted.
* **The tiny model's tokenizer.** With ``hf_accum:tiny-llama`` and the user's data, the word-level
  vocabulary is built from that data (:func:`hf_accum.recipe.embedded.tiny_vocabulary`) and any ``<unk>``
  left is counted in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_accum.recipe import embedded, modeling
from hf_accum.recipe.config import DataSection, ModelSection, RecipeConfig
from hf_accum.recipe.data.encoding import (
    EncodedSplit,
    encode_examples,
    prompt_ids,
    render,
)
from hf_accum.recipe.data.formats import (
    FORMATS,
    PREFERENCE_FORMATS,
    Example,
    RowFormat,
    resolve_format,
    to_example,
    to_examples,
)
from hf_accum.recipe.data.metric import exact_match, normalize_answer
from hf_accum.recipe.data.reading import (
    DataError,
    check_disk_dir,
    check_local_file,
    dataset_source,
    read_local,
    refuse_url,
)
from hf_accum.recipe.data.splits import Splits, check_split_spec, load_splits
from hf_accum.recipe.embedded import EMBEDDED_DATASET, SPECIAL_TOKENS, TINY_MODEL

# Tokenizers are Any (transformers' or the tiny word-level one; their calls are typed as unions).

__all__ = [
    "FORMATS", "PREFERENCE_FORMATS", "DataError", "EncodedSplit", "Example", "RecipeData", "RowFormat", "Splits",
    "check_local_file", "check_split_spec", "dataset_source", "encode_examples", "exact_match", "load_splits",
    "load_tokenizer_and_data", "normalize_answer", "prompt_ids", "read_local", "render", "resolve_format", "to_example",
    "to_examples",
]


def check_data_section(data: DataSection, config: RecipeConfig | None = None) -> None:
    """The data section's own check (run by :mod:`hf_accum.recipe.checks`): what can be known without reading the
    data -- values, files, split names. Raises :class:`DataError` naming the key."""
    if data.format not in ("auto", *FORMATS, *PREFERENCE_FORMATS):
        raise DataError(f"data.format={data.format!r}; allowed: auto, {', '.join((*FORMATS, *PREFERENCE_FORMATS))}")
    minimums = {"max_length": 2, "num_train_examples": 1, "num_eval_examples": 0, "max_eval_examples": 0,
                "eval_max_new_tokens": 1}
    for key, minimum in minimums.items():
        if getattr(data, key) < minimum:
            raise DataError(f"data.{key}={getattr(data, key)} must be >= {minimum}")
    if not 0 <= data.eval_fraction < 1:
        raise DataError(f"data.eval_fraction={data.eval_fraction} must be >= 0 and < 1")
    refuse_url("data.dataset", data.dataset)
    try:
        if dataset_source(data.dataset) == "local":
            check_local_file(data.dataset)
        if dataset_source(data.dataset) == "disk":
            check_disk_dir(data.dataset)
        check_split_spec(data.dataset, "data.train_split", data.train_split)
        check_split_spec(data.dataset, "data.eval_split", data.eval_split)
    except DataError as exc:
        key = "data.dataset: " if str(exc).startswith("data file") else ""
        raise DataError(f"{key}{exc}") from exc


@dataclass
class RecipeData:
    """Everything the recipe trains and scores on, and the lines to print about it."""

    train: EncodedSplit
    held_out: EncodedSplit | None
    """The held-out rows encoded like the training rows (a held-out loss); None when there are none."""
    eval_rows: list[Example]
    """Held-out conversations scored by :func:`exact_match` (none for the text format)."""
    format: str
    report: list[str]


def load_tokenizer_and_data(model: ModelSection, data: DataSection) -> tuple[Any, RecipeData]:
    """The tokenizer and the encoded data of a run, from its ``model`` and ``data`` config sections
    (:class:`hf_accum.recipe.config.ModelSection`, :class:`hf_accum.recipe.config.DataSection`).

    Everything is read, checked and encoded here, before any model is loaded; problems raise
    :class:`DataError` (one line). With ``hf_accum:tiny-llama`` and the user's own data, the
    tokenizer's vocabulary is built from that data. ``RecipeData.report`` says what was done.
    """
    splits = load_splits(data)
    corpus = None
    if model.name_or_path == TINY_MODEL and data.dataset != EMBEDDED_DATASET:
        corpus = [text for example in (*splits.train, *splits.held_out) for text in example.texts()]
    source = model.tokenizer or model.name_or_path
    tokenizer = modeling.load_tokenizer(source, model.chat_template, model.trust_remote_code, corpus=corpus,
                                        gguf_file=None if model.tokenizer else model.gguf_file)
    train = encode_examples(tokenizer, splits.train, data.max_length)
    if not train.examples:
        raise DataError(
            f"data.max_length={data.max_length} leaves no answer token in any of the {train.dropped} training examples "
            f"(the longest prompt is {train.longest_prompt} tokens); raise data.max_length above {train.longest_prompt}"
        )
    held_out = encode_examples(tokenizer, splits.held_out, data.max_length) if splits.held_out else None
    report = [*splits.report, f"train: {train.summary()}"]
    report += _encoding_notes(train, held_out, data, splits.format)
    report += _tokenizer_notes(tokenizer, train, held_out, corpus is not None)
    eval_rows = [example for example in splits.held_out if example.messages is not None]
    return tokenizer, RecipeData(train, held_out, eval_rows, splits.format.name, report)


def _encoding_notes(train: EncodedSplit, held_out: EncodedSplit | None, data: DataSection,
                    fmt: RowFormat) -> list[str]:
    notes = []
    if train.dropped:
        notes.append(f"note: {train.dropped} training examples had no answer token within data.max_length="
                     f"{data.max_length} (longest prompt: {train.longest_prompt} tokens) and are skipped")
    if train.untrained_turns:
        notes.append(f"note: {train.untrained_turns} earlier assistant messages are not trained on: the chat template "
                     "renders them differently once later turns follow (each conversation's last answer is)")
    if fmt.name == "text":
        notes.append("note: format text trains on every token; its held-out rows have no answer to score "
                     "(no exact match)")
        if not data.packing:
            notes.append("note: data.packing=true is recommended for text (no compute spent on padding)")
    if held_out is not None and held_out.dropped:
        notes.append(f"note: {held_out.dropped} held-out examples have no answer token within data.max_length")
    return notes


def _tokenizer_notes(tokenizer: Any, train: EncodedSplit, held_out: EncodedSplit | None,
                     built_from_data: bool) -> list[str]:
    splits = [s for s in (train, held_out) if s is not None]
    unknown, tokens = sum(s.unknown for s in splits), sum(s.tokens for s in splits)
    if built_from_data:
        words = len(tokenizer) - len(SPECIAL_TOKENS)
        return [f"tokenizer: word-level, built from the training and held-out rows: {words} words (at most "
                f"{embedded.TINY_VOCAB_LIMIT}); <unk> left: {unknown} of {tokens} tokens"]
    if unknown:
        return [f"note: {unknown} of {tokens} tokens of the data are {tokenizer.unk_token} for this tokenizer"]
    return []
