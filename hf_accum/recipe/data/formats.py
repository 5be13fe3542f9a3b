"""Formats: the user's rows -> examples (a conversation ending in the assistant's answer, or plain text;
for preference data, that conversation plus a rejected answer to the same prompt).

The format is detected from the columns (first match in the order of :data:`FORMATS`, or of
:data:`PREFERENCE_FORMATS` for ``objective: dpo``) or forced with ``data.format``; ``data.<role>_column``
renames a column. A row that cannot be trained on is a :class:`BadRow`; :func:`to_examples` counts them by
kind and refuses the whole dataset, naming the first.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from hf_accum.recipe.config import DataSection
from hf_accum.recipe.data.reading import DataError, RawRow

FORMATS = ("chat", "prompt_completion", "alpaca", "text")
# Preference data (objective: dpo), detected in this order; never picked for SFT. ``preference``: TRL's explicit
# prompt (prompt + chosen + rejected, each a string or a message list); ``preference_implicit``: TRL's implicit
# prompt (chosen and rejected are whole conversations that share every message but the last answer).
PREFERENCE_FORMATS = ("preference", "preference_implicit")
# The columns each format reads, by role, with their usual names (the first one present is used).
# ``input`` is optional: alpaca's context, joined into the user message. ``data.<role>_column``
# replaces the usual names (and makes the column required).
FORMAT_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "chat": {"messages": ("messages", "conversations")},
    "prompt_completion": {"prompt": ("prompt", "question"), "answer": ("completion", "answer"), "input": ()},
    "alpaca": {"prompt": ("instruction",), "answer": ("output",), "input": ("input",)},
    "text": {"text": ("text",)},
    "preference": {"prompt": ("prompt",), "chosen": ("chosen",), "rejected": ("rejected",)},
    "preference_implicit": {"chosen": ("chosen",), "rejected": ("rejected",)},
}
OPTIONAL_ROLES = {"input"}
# ShareGPT conversations (``conversations``: ``[{"from", "value"}, ...]``): their speakers, as chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class RowFormat:
    """How the rows of one dataset become examples: the format and the column of each role."""

    name: str
    columns: dict[str, str]
    system_prompt: str | None = None

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.columns.values())})"


@dataclass
class Example:
    """One row, format-independent: a conversation ending with the assistant's answer, or plain text."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    task: str = "all"
    """Group for the per-task exact match (a ``task`` column, as in the embedded dataset)."""
    where: str = ""
    rejected: dict[str, str] | None = None
    """Preference formats only: the rejected assistant answer to ``messages[:-1]`` (``messages[-1]`` is the
    chosen one)."""

    def conversation(self) -> list[dict[str, str]]:
        """``messages``, for the code that reads conversational examples only (every format but ``text``)."""
        assert self.messages is not None, f"{self.where}: a text example has no messages"
        return self.messages

    def texts(self) -> list[str]:
        if self.text is not None:
            return [self.text]
        return [m["content"] for m in (*(self.messages or []), *([self.rejected] if self.rejected else []))]

    def key(self) -> str:
        """Content identity (to spot held-out rows that duplicate training rows)."""
        if self.rejected is not None:
            return json.dumps([self.messages, self.rejected], sort_keys=True)
        return json.dumps([self.messages, self.text], sort_keys=True)


class BadRow(ValueError):
    """A row that cannot be trained on: ``kind`` groups the count, ``str()`` is the detail."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def resolve_format(present: Iterable[str], data: DataSection, source: str,
                   formats: Sequence[str] = FORMATS) -> RowFormat:
    """The format of a dataset with columns ``present``: ``data.format``, or the first of ``formats`` that
    fits (:data:`FORMATS` for SFT, :data:`PREFERENCE_FORMATS` for DPO).

    ``data`` is a :class:`hf_accum.recipe.config.DataSection` (its ``format``, ``*_column`` and
    ``system_prompt`` are read).
    """
    present = set(present)
    candidates = formats if data.format == "auto" else (data.format,)
    for name in candidates:
        columns = _format_columns(name, present, data)
        if columns is not None:
            return RowFormat(name, columns, data.system_prompt)
    found = ", ".join(sorted(present)) or "none"
    if data.format != "auto":
        raise DataError(
            f"data.format={data.format}: {source} lacks column(s) {_needed_columns(data.format, data)} "
            f"(its columns: {found}); name yours with data.<role>_column"
        )
    allowed = "; ".join(f"{name}: {_needed_columns(name, data)}" for name in formats)
    if formats == PREFERENCE_FORMATS:
        raise DataError(f"objective=dpo needs preference data, but {source} has the columns {found}; preference "
                        f"formats and their columns: {allowed} (each a string or a list of messages)")
    hint = next((f" ({source} looks like preference data ({name}): train it with objective=dpo)"
                 for name in PREFERENCE_FORMATS if _format_columns(name, present, data) is not None), "")
    raise DataError(
        f"cannot tell the format of {source} from its columns ({found}){hint}; formats and their columns: {allowed}. "
        "Force one with data.format=... and name your columns with data.prompt_column / data.answer_column / "
        "data.input_column / data.messages_column / data.text_column"
    )


def _format_columns(name: str, present: set[str], data: DataSection) -> dict[str, str] | None:
    columns = {}
    for role, usual in FORMAT_COLUMNS[name].items():
        chosen = getattr(data, f"{role}_column", None)
        found = next((c for c in ((chosen,) if chosen else usual) if c in present), None)
        if found is not None:
            columns[role] = found
        elif chosen or role not in OPTIONAL_ROLES:
            return None
    return columns


def _needed_columns(name: str, data: DataSection) -> str:
    parts = []
    for role, usual in FORMAT_COLUMNS[name].items():
        chosen = getattr(data, f"{role}_column", None)
        names = " or ".join(repr(c) for c in ((chosen,) if chosen else usual))
        if names:
            parts.append(f"optional {names}" if role in OPTIONAL_ROLES and not chosen else names)
    return " + ".join(parts)


def to_example(values: dict[str, Any], fmt: RowFormat, where: str = "") -> Example:
    """One row as an :class:`Example`; raises :class:`BadRow` when it cannot be trained on."""
    task = values["task"] if isinstance(values.get("task"), str) else "all"
    if fmt.name in PREFERENCE_FORMATS:
        return _preference_example(values, fmt, where, task)
    if fmt.name == "text":
        return Example(text=_required_text(values, fmt.columns["text"], "text"), task=task, where=where)
    if fmt.name == "chat":
        messages = _conversation(values.get(fmt.columns["messages"]), fmt.columns["messages"])
    else:
        prompt = _required_text(values, fmt.columns["prompt"], "prompt", allow_empty=True)
        context = _optional_text(values, fmt.columns.get("input"))
        user = f"{prompt}\n\n{context}" if context else prompt
        answer = _required_text(values, fmt.columns["answer"], "answer")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    if fmt.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": fmt.system_prompt})
    return Example(messages=messages, task=task, where=where)


# ----------------------------------------------------------------------------------------------
# Preference rows (TRL's formats: https://huggingface.co/docs/trl/dataset_formats#preference)
# ----------------------------------------------------------------------------------------------


def _preference_example(values: dict[str, Any], fmt: RowFormat, where: str, task: str) -> Example:
    """A preference row as the chosen conversation plus the rejected answer (:attr:`Example.rejected`)."""
    if fmt.name == "preference":
        prompt = _prompt_messages(values, fmt.columns["prompt"])
        chosen = _completion(values, fmt.columns["chosen"])
        rejected = _completion(values, fmt.columns["rejected"])
    else:
        prompt, chosen, rejected = _shared_prompt(values, fmt.columns["chosen"], fmt.columns["rejected"])
    if chosen["content"] == rejected["content"]:
        raise BadRow("whose chosen and rejected answers are the same", "the chosen and rejected answers are the same")
    if fmt.system_prompt and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": fmt.system_prompt})
    return Example(messages=[*prompt, chosen], rejected=rejected, task=task, where=where)


def _prompt_messages(values: dict[str, Any], column: str) -> list[dict[str, str]]:
    """The prompt: a string (one user message) or a list of messages not ending with the assistant."""
    value = values.get(column)
    if not isinstance(value, (list, tuple)):
        return [{"role": "user", "content": _required_text(values, column, "prompt", allow_empty=True)}]
    kind = f"without a prompt conversation in {column!r}"
    if not value:
        raise BadRow(kind, f"{column!r} is an empty list of messages")
    messages = [_message(message, i, kind) for i, message in enumerate(value, start=1)]
    if messages[-1]["role"] == "assistant":
        raise BadRow(kind, f"{column!r} ends with an assistant message: the answer belongs in the chosen/rejected "
                           "columns")
    return messages


def _completion(values: dict[str, Any], column: str) -> dict[str, str]:
    """A chosen or rejected answer: a string, or a list holding one assistant message."""
    value = values.get(column)
    kind = f"without one assistant answer in {column!r}"
    if not isinstance(value, (list, tuple)):
        return {"role": "assistant", "content": _required_text(values, column, column)}
    if len(value) != 1:
        raise BadRow(kind, f"{column!r} holds {len(value)} messages, not one assistant answer")
    message = _message(value[0], 1, kind)
    if message["role"] != "assistant" or not message["content"].strip():
        raise BadRow(kind, f"{column!r} holds a message from {message['role']!r}"
                           + (", not the assistant" if message["role"] != "assistant" else " that is empty"))
    return message


def _shared_prompt(values: dict[str, Any], chosen_column: str,
                   rejected_column: str) -> tuple[list[dict[str, str]], dict[str, str], dict[str, str]]:
    """TRL's implicit prompt: two conversations equal up to their last message, each an assistant answer."""
    kind = "whose chosen and rejected conversations do not share a prompt"
    chosen, rejected = (_conversation(values.get(column), column) for column in (chosen_column, rejected_column))
    if chosen[:-1] != rejected[:-1]:
        raise BadRow(kind, f"{chosen_column!r} and {rejected_column!r} differ before their last message (the "
                           "prompt must be every message but the answer; or give a 'prompt' column)")
    return chosen[:-1], chosen[-1], rejected[-1]


def _as_text(value: Any) -> str | None:
    """Strings as they are, numbers as text (e.g. numeric answers); anything else is not text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not _is_nan(value):
        return str(value)
    return None


def _is_nan(value: Any) -> bool:
    """Empty cells of csv/parquet files arrive as NaN floats."""
    return isinstance(value, float) and math.isnan(value)


def _required_text(values: dict[str, Any], column: str, role: str, allow_empty: bool = False) -> str:
    kind = f"without {'an' if role[0] in 'aeiou' else 'a'} {role} in {column!r}"
    if column not in values:
        raise BadRow(kind, f"no {column!r} field")
    value = values[column]
    if value is None or _is_nan(value):
        raise BadRow(kind, f"{column!r} is null")
    text = _as_text(value)
    if text is None:
        raise BadRow(kind, f"{column!r} is a {type(value).__name__}, not text")
    if not allow_empty and not text.strip():
        raise BadRow(kind, f"{column!r} is empty")
    return text


def _optional_text(values: dict[str, Any], column: str | None) -> str:
    if column is None or values.get(column) is None:
        return ""
    text = _as_text(values[column])
    if text is None:
        raise BadRow(f"with a non-text {column!r}", f"{column!r} is a {type(values[column]).__name__}, not text")
    return text.strip()


def _conversation(value: Any, column: str) -> list[dict[str, str]]:
    kind = f"without a conversation ending in an assistant answer in {column!r}"
    if not isinstance(value, (list, tuple)) or not value:
        raise BadRow(kind, f"{column!r} is {'empty' if value in ([], ()) else 'not a list of messages'}")
    messages = [_message(message, i, kind) for i, message in enumerate(value, start=1)]
    if messages[-1]["role"] != "assistant":
        raise BadRow(kind, f"the last message is from {messages[-1]['role']!r}, not the assistant")
    if not messages[-1]["content"].strip():
        raise BadRow(kind, "the assistant's last message is empty")
    if len(messages) == 1:
        raise BadRow(kind, "the assistant's answer has no message before it")
    return messages


def _message(message: Any, number: int, kind: str) -> dict[str, str]:
    """One message as ``{"role", "content"}``: a chat message (``role``/``content``) or a ShareGPT one
    (``from``/``value``, its speaker mapped by :data:`SHAREGPT_ROLES`)."""
    if isinstance(message, dict) and "from" in message and "role" not in message:
        return _sharegpt_message(message, number, kind)
    role = message.get("role") if isinstance(message, dict) else None
    content = _as_text(message.get("content")) if isinstance(message, dict) else None
    if not isinstance(role, str) or content is None:
        raise BadRow(kind, f"message {number} needs a 'role' and a text 'content' (or ShareGPT's 'from' and 'value')")
    return {"role": role, "content": content}


def _sharegpt_message(message: dict[str, Any], number: int, kind: str) -> dict[str, str]:
    speaker, content = message.get("from"), _as_text(message.get("value"))
    if speaker not in SHAREGPT_ROLES:
        known = ", ".join(SHAREGPT_ROLES)
        raise BadRow(f"with a ShareGPT speaker other than {known}",
                     f"message {number} is from {speaker!r}; ShareGPT speakers: {known}")
    if content is None:
        raise BadRow(kind, f"message {number} (from {speaker!r}) needs a text 'value'")
    return {"role": SHAREGPT_ROLES[speaker], "content": content}


def to_examples(rows: Sequence[RawRow], fmt: RowFormat, source: str) -> list[Example]:
    """Every row as an :class:`Example`, or one :class:`DataError` counting the bad rows by kind and
    naming the first (with its line in a jsonl file)."""
    examples, bad = [], []
    for where, values in rows:
        try:
            examples.append(to_example(values, fmt, where))
        except BadRow as exc:
            bad.append((where, exc))
    if bad:
        kinds = Counter(exc.kind for _, exc in bad)
        counts = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
        where, first = bad[0]
        raise DataError(
            f"{source}: {len(bad)} of {len(rows)} rows cannot be trained on ({counts}); first: {where}: {first}. "
            f"Fix or remove them (format {fmt.describe()})"
        )
    return examples
