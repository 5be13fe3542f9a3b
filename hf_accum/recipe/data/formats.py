"""Formats: the user's rows -> examples (a conversation ending in the assistant's answer, or plain text).

The format is detected from the columns (first match in the order of :data:`FORMATS`) or forced
with ``data.format``; ``data.<role>_column`` renames a column. A row that cannot be trained on is a
:class:`BadRow`; :func:`to_examples` counts them by kind and refuses the whole dataset, naming the first.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from hf_accum.recipe.data.reading import DataError, RawRow

FORMATS = ("chat", "prompt_completion", "alpaca", "text")
# The columns each format reads, by role, with their usual names (the first one present is used).
# ``input`` is optional: alpaca's context, joined into the user message. ``data.<role>_column``
# replaces the usual names (and makes the column required).
FORMAT_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "chat": {"messages": ("messages", "conversations")},
    "prompt_completion": {"prompt": ("prompt", "question"), "answer": ("completion", "answer"), "input": ()},
    "alpaca": {"prompt": ("instruction",), "answer": ("output",), "input": ("input",)},
    "text": {"text": ("text",)},
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

    def texts(self) -> list[str]:
        return [self.text] if self.text is not None else [m["content"] for m in self.messages or []]

    def key(self) -> str:
        """Content identity (to spot held-out rows that duplicate training rows)."""
        return json.dumps([self.messages, self.text], sort_keys=True)


class BadRow(ValueError):
    """A row that cannot be trained on: ``kind`` groups the count, ``str()`` is the detail."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def resolve_format(present: Iterable[str], data, source: str) -> RowFormat:
    """The format of a dataset with columns ``present``: ``data.format``, or the first that fits.

    ``data`` is a :class:`hf_accum.recipe.config.DataSection` (its ``format``, ``*_column`` and
    ``system_prompt`` are read).
    """
    present = set(present)
    candidates = FORMATS if data.format == "auto" else (data.format,)
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
    allowed = "; ".join(f"{name}: {_needed_columns(name, data)}" for name in FORMATS)
    raise DataError(
        f"cannot tell the format of {source} from its columns ({found}); formats and their columns: {allowed}. "
        "Force one with data.format=... and name your columns with data.prompt_column / data.answer_column / "
        "data.input_column / data.messages_column / data.text_column"
    )


def _format_columns(name: str, present: set[str], data) -> dict[str, str] | None:
    columns = {}
    for role, usual in FORMAT_COLUMNS[name].items():
        chosen = getattr(data, f"{role}_column", None)
        found = next((c for c in ((chosen,) if chosen else usual) if c in present), None)
        if found is not None:
            columns[role] = found
        elif chosen or role not in OPTIONAL_ROLES:
            return None
    return columns


def _needed_columns(name: str, data) -> str:
    parts = []
    for role, usual in FORMAT_COLUMNS[name].items():
        chosen = getattr(data, f"{role}_column", None)
        names = " or ".join(repr(c) for c in ((chosen,) if chosen else usual))
        if names:
            parts.append(f"optional {names}" if role in OPTIONAL_ROLES and not chosen else names)
    return " + ".join(parts)


def to_example(values: dict[str, Any], fmt: RowFormat, where: str = "") -> Example:
    """One row as an :class:`Example`; raises :class:`BadRow` when it cannot be trained on."""
    task = values.get("task") if isinstance(values.get("task"), str) else "all"
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
