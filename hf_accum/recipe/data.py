"""The recipe's data: the user's own rows in every common format, held-out splits, bad-row checks,
prompt masking with ``labels``, the embedded default dataset, and the exact-match metric.

The recipe calls one function, :func:`load_tokenizer_and_data` ``(model_section, data_section)``,
which reads, checks, splits and encodes everything before any model is loaded. What it does:

* **Reading.** Local ``.jsonl`` and ``.json`` files are read here, line by line, so that a malformed
  line or invalid UTF-8 is reported with its line number; ``.parquet``, ``.csv`` and ``datasets``
  hub names are read through ``datasets``. ``hf_accum:synthetic-tasks`` is generated in-process.
* **Formats**, detected from the columns (first match in this order) or forced with ``data.format``:

  ===================  =============================================  ================================
  format               columns                                        trained on
  ===================  =============================================  ================================
  chat                 ``messages`` (``role``/``content`` dicts)      every assistant message
  prompt_completion    ``prompt`` + ``completion`` (or ``answer``)    the completion
  alpaca               ``instruction`` + ``output``, opt. ``input``   the output
  text                 ``text``                                       every token
  ===================  =============================================  ================================

  The non-text formats become a conversation rendered with the model's chat template (alpaca's
  ``input`` is joined into the user message). ``data.<role>_column`` renames a column.
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
  vocabulary is built from that data (:func:`hf_accum.recipe.modeling.tiny_vocabulary`) and any ``<unk>``
  left is counted in the report.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from hf_accum.loss import IGNORE_INDEX

EMBEDDED_DATASET = "hf_accum:synthetic-tasks"
# Local file types; the value names the ``datasets`` builder for those read through ``datasets``.
LOCAL_SUFFIXES = {".jsonl": None, ".json": None, ".parquet": "parquet", ".csv": "csv"}

# ----------------------------------------------------------------------------------------------
# The embedded synthetic instruction dataset
# ----------------------------------------------------------------------------------------------

# Plain words for copy/reverse/last-word tasks; made-up countries and cities for lookups
# (made up so that no "world knowledge" is needed: the answer is always in the prompt).
WORDS = (
    "apple river stone cloud green seven lamp tiger paper window music orange silver forest "
    "bread candle mirror rocket garden winter honey planet button dragon pencil ocean castle "
    "violet thunder marble yellow basket feather jungle anchor lemon shadow copper whistle"
).split()
_SYLLABLES = "zor bel kan tri vo mur sel dun pa ri lo fen gar ti nu qua".split()
TASKS = ("copy", "reverse", "lookup", "last")


def _made_up_names(rng: random.Random, count: int, suffix: str) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.sample(_SYLLABLES, 2)) + suffix)
    return sorted(names)


COUNTRIES = _made_up_names(random.Random(1), 24, "ia")
CITIES = _made_up_names(random.Random(2), 24, "burg")


def synthetic_example(rng: random.Random, task: str) -> dict[str, str]:
    """One example of ``task``. Tokens are space separated so a word-level tokenizer round-trips them."""
    if task == "copy":
        words = rng.choices(WORDS, k=rng.randint(1, 10))
        return {"task": task, "prompt": "repeat the words : " + " ".join(words), "answer": " ".join(words)}
    if task == "reverse":
        words = rng.choices(WORDS, k=rng.randint(1, 6))
        return {"task": task, "prompt": "reverse the words : " + " ".join(words), "answer": " ".join(words[::-1])}
    if task == "lookup":
        countries = rng.sample(COUNTRIES, rng.randint(2, 8))
        cities = rng.sample(CITIES, len(countries))
        table = " ; ".join(f"{c} = {t}" for c, t in zip(countries, cities))
        asked = rng.randrange(len(countries))
        prompt = f"capitals : {table} . what is the capital of {countries[asked]} ?"
        return {"task": task, "prompt": prompt, "answer": cities[asked]}
    if task == "last":
        words = rng.choices(WORDS, k=rng.randint(2, 14))
        return {"task": task, "prompt": "last word of : " + " ".join(words), "answer": words[-1]}
    raise ValueError(f"unknown synthetic task {task!r}; known: {TASKS}")


def synthetic_rows(num_examples: int, seed: int) -> list[dict[str, str]]:
    """``num_examples`` rows cycling through the tasks, fully determined by ``seed``."""
    rng = random.Random(seed)
    return [synthetic_example(rng, TASKS[i % len(TASKS)]) for i in range(num_examples)]


def synthetic_splits(num_train: int, num_eval: int, seed: int) -> dict[str, list[dict[str, str]]]:
    """Train and held-out splits; held-out rows that also occur in train are replaced, so the
    metric measures generalisation, not memorisation."""
    train = synthetic_rows(num_train, seed)
    seen = {(r["prompt"], r["answer"]) for r in train}
    rng = random.Random(seed + 10_007)
    held_out: list[dict[str, str]] = []
    while len(held_out) < num_eval:
        row = synthetic_example(rng, TASKS[len(held_out) % len(TASKS)])
        if (row["prompt"], row["answer"]) not in seen:
            held_out.append(row)
    return {"train": train, "test": held_out}


def synthetic_corpus() -> list[str]:
    """Every word the synthetic tasks can produce (the default tokenizer's vocabulary source)."""
    fixed = "repeat reverse the words : capitals ; = . what is capital of ? last word".split()
    return fixed + WORDS + COUNTRIES + CITIES


# ----------------------------------------------------------------------------------------------
# Reading rows, each with where it came from
# ----------------------------------------------------------------------------------------------


class DataError(ValueError):
    """Bad data configuration or content; the message is one line naming the file, row or key."""


# A row and where it came from ("line 17", "row 3 of split 'train'"), for error messages.
RawRow = tuple[str, dict[str, Any]]


def dataset_source(name: str) -> str:
    """``embedded``, ``local`` (a file path) or ``hub`` (a ``datasets`` name)."""
    if name == EMBEDDED_DATASET:
        return "embedded"
    if os.path.splitext(name)[1] in LOCAL_SUFFIXES or os.path.isfile(name):
        return "local"
    return "hub"


def check_local_file(path: str) -> None:
    """Fail fast (before any model is loaded) on a missing, empty or unsupported local data file."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path!r} (cwd: {os.getcwd()})")
    suffix = os.path.splitext(path)[1]
    if suffix not in LOCAL_SUFFIXES:
        raise DataError(f"data file {path!r}: unsupported type {suffix!r}; allowed: {', '.join(LOCAL_SUFFIXES)}")
    if os.path.getsize(path) == 0:
        raise DataError(f"data file is empty: {path!r}")


def read_local(path: str) -> list[RawRow]:
    """Every row of a local file, in file order."""
    check_local_file(path)
    suffix = os.path.splitext(path)[1]
    if suffix == ".jsonl":
        return _json_lines(path, _decoded_lines(path))
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".csv":
        for _ in _decoded_lines(path):  # datasets would raise a bare UnicodeDecodeError
            pass
    rows = _load_with_datasets(path, LOCAL_SUFFIXES[suffix], data_files={"train": path}, split="train")
    return [(f"row {i + 1}", dict(values)) for i, values in enumerate(rows)]


def read_hub(name: str, split: str, config_name: str | None = None) -> list[RawRow]:
    """Every row of one (unsliced) split of a ``datasets`` name."""
    rows = _load_with_datasets(f"{name} split {split!r}", name, config_name, split=split)
    return [(f"row {i + 1} of split {split!r}", dict(values)) for i, values in enumerate(rows)]


def _load_with_datasets(what: str, *args: Any, **kwargs: Any):
    import datasets

    try:
        return datasets.load_dataset(*args, **kwargs)
    except (datasets.exceptions.DatasetsError, ValueError, KeyError, OSError) as exc:
        # datasets says "corresponds to no data" for empty files; unknown names/splits land here too.
        detail = " ".join(str(exc).split())
        raise DataError(f"cannot load {what}: {detail[:300]}") from exc


def _decoded_lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file; invalid UTF-8 is reported with its line and byte."""
    offset = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: line {number}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}, "
                    f"file offset {offset + exc.start}); save the file as UTF-8"
                ) from None
            offset += len(raw)
            yield number, text.removeprefix("\ufeff") if number == 1 else text


def _json_lines(path: str, lines: Iterable[tuple[int, str]]) -> list[RawRow]:
    rows = []
    for number, line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {number}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(value, dict):
            kind = type(value).__name__
            raise DataError(f"{path}: line {number}: expected one JSON object {{...}} per line, got {kind}")
        rows.append((f"line {number}", value))
    return rows


def _read_json(path: str) -> list[RawRow]:
    """A ``.json`` file holds either one array of objects or JSON lines (as ``datasets`` accepts)."""
    lines = list(_decoded_lines(path))
    text = "".join(line for _, line in lines)
    if not text.lstrip().startswith("["):
        return _json_lines(path, lines)
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    for i, value in enumerate(values):
        if not isinstance(value, dict):
            kind = type(value).__name__
            raise DataError(f"{path}: item {i + 1} of the array: expected a JSON object {{...}}, got {kind}")
    return [(f"item {i + 1}", value) for i, value in enumerate(values)]


# ----------------------------------------------------------------------------------------------
# Formats: rows -> examples (a conversation, or plain text)
# ----------------------------------------------------------------------------------------------

FORMATS = ("chat", "prompt_completion", "alpaca", "text")
# The columns each format reads, by role, with their usual names (the first one present is used).
# ``input`` is optional: alpaca's context, joined into the user message. ``data.<role>_column``
# replaces the usual names (and makes the column required).
FORMAT_COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    "chat": {"messages": ("messages",)},
    "prompt_completion": {"prompt": ("prompt",), "answer": ("completion", "answer"), "input": ()},
    "alpaca": {"prompt": ("instruction",), "answer": ("output",), "input": ("input",)},
    "text": {"text": ("text",)},
}
OPTIONAL_ROLES = {"input"}


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
    messages = []
    for i, message in enumerate(value, start=1):
        role = message.get("role") if isinstance(message, dict) else None
        content = _as_text(message.get("content")) if isinstance(message, dict) else None
        if not isinstance(role, str) or content is None:
            raise BadRow(kind, f"message {i} needs a 'role' and a text 'content'")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "assistant":
        raise BadRow(kind, f"the last message is from {messages[-1]['role']!r}, not the assistant")
    if not messages[-1]["content"].strip():
        raise BadRow(kind, "the assistant's last message is empty")
    if len(messages) == 1:
        raise BadRow(kind, "the assistant's answer has no message before it")
    return messages


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


# ----------------------------------------------------------------------------------------------
# Splits: training rows and disjoint held-out rows
# ----------------------------------------------------------------------------------------------

# A row's identity inside its dataset: (unsliced split name, index).
RowKey = tuple[str, int]


def split_names(spec: str) -> list[str]:
    """The unsliced splits a split spec reads: ``"train[:90%]+test"`` -> ``["train", "test"]``."""
    return [part.split("[", 1)[0].strip() for part in spec.split("+")]


def check_split_spec(dataset: str, key: str, spec: str | None) -> None:
    """Refuse, before anything is loaded, a split that cannot be read from ``dataset``."""
    if spec is None:
        return
    if dataset_source(dataset) == "embedded":
        allowed = {"data.train_split": ("train",), "data.eval_split": ("test",)}[key]
        if spec not in allowed:
            raise DataError(
                f"{key}={spec!r}: {EMBEDDED_DATASET} has the splits 'train' (data.num_train_examples rows) and "
                "'test' (data.num_eval_examples held-out rows)"
            )
        return
    if dataset_source(spec) == "local":
        if key != "data.eval_split":
            raise DataError(f"{key}={spec!r}: name the training file in data.dataset")
        check_local_file(spec)
        return
    import datasets

    try:
        datasets.ReadInstruction.from_spec(spec)
    except (ValueError, AssertionError) as exc:
        raise DataError(f"{key}={spec!r} is not a split: {exc} (e.g. 'train', 'train[:90%]', 'test')") from None
    if dataset_source(dataset) == "local" and set(split_names(spec)) != {"train"}:
        raise DataError(
            f"{key}={spec!r}: {dataset!r} is a single local file (split 'train'); leave data.eval_split unset to "
            "hold out data.eval_fraction of its rows, use a slice such as 'train[90%:]', or the path of a second file"
        )


class DatasetRows:
    """The rows of one dataset (a local file or a hub name), each unsliced split read once."""

    def __init__(self, name: str, config_name: str | None = None):
        self.name = name
        self.config_name = config_name
        self._splits: dict[str, list[RawRow]] = {}

    def _is_local(self) -> bool:
        return dataset_source(self.name) == "local"

    def split(self, name: str) -> list[RawRow]:
        if name not in self._splits:
            rows = read_local(self.name) if self._is_local() else read_hub(self.name, name, self.config_name)
            self._splits[name] = rows
        return self._splits[name]

    def select(self, key: str, spec: str) -> list[RowKey]:
        """The rows a split spec (``train``, ``train[:90%]``, ``train[10:20]+test``) selects, in order."""
        import datasets

        sizes = {name: len(self.split(name)) for name in split_names(spec)}
        try:
            ranges = datasets.ReadInstruction.from_spec(spec).to_absolute(sizes)
        except (ValueError, AssertionError) as exc:
            raise DataError(f"{key}={spec!r}: {exc}") from None
        keys = [(r.splitname, i) for r in ranges for i in range(r.from_, r.to)]
        if not any(sizes.values()):
            raise DataError(f"{self.name} holds no rows" + (" (blank lines only)" if self._is_local() else ""))
        if not keys:
            sizes_text = ", ".join(f"{n}: {s} rows" for n, s in sizes.items())
            raise DataError(f"{key}={spec!r} selects no rows of {self.name} ({sizes_text})")
        return keys

    def rows(self, keys: Iterable[RowKey]) -> list[RawRow]:
        return [self.split(name)[i] for name, i in keys]


@dataclass
class Splits:
    """Training and held-out examples, their format, and what was done (for the run's report)."""

    train: list[Example]
    held_out: list[Example]
    format: RowFormat
    report: list[str] = field(default_factory=list)


def load_splits(data) -> Splits:
    """Training and held-out examples for a :class:`hf_accum.recipe.config.DataSection`; every row checked.

    Held-out rows: ``data.eval_split`` (a split or slice of ``data.dataset``, or a second local
    file), else ``data.eval_fraction`` of the training rows carved at random (seeded by
    ``data.seed``, at most ``data.max_eval_examples``). They are never trained on.
    """
    if data.dataset == EMBEDDED_DATASET:
        return _embedded_splits(data)
    check_split_spec(data.dataset, "data.train_split", data.train_split)
    check_split_spec(data.dataset, "data.eval_split", data.eval_split)
    source = DatasetRows(data.dataset, data.dataset_config)
    train_keys, eval_keys, held_out_line = _choose_rows(source, data)
    # The rows of one dataset are checked together, so that one message counts every bad row.
    chosen = sorted(set(train_keys) | set(eval_keys))
    rows = source.rows(chosen)
    fmt = resolve_format(_columns(rows), data, data.dataset)
    examples = dict(zip(chosen, to_examples(rows, fmt, data.dataset)))
    train, held_out = [examples[k] for k in train_keys], [examples[k] for k in eval_keys]
    if _held_out_file(data):
        held_out = _file_examples(data.eval_split, data)
        held_out_line += f" ({len(held_out)} rows)"
    report = [f"data: {data.dataset}: format {fmt.describe()}{_ignored_columns(rows, fmt)}", held_out_line]
    report += _held_out_notes(train, held_out, data.max_eval_examples)
    return Splits(train, held_out[: data.max_eval_examples], fmt, report)


def _held_out_file(data) -> bool:
    return data.eval_split is not None and dataset_source(data.eval_split) == "local"


def _choose_rows(source: DatasetRows, data) -> tuple[list[RowKey], list[RowKey], str]:
    """``(training rows, held-out rows, what was done)`` of ``source``; the two never overlap. A
    held-out second file contributes no rows of ``source``."""
    train_keys = source.select("data.train_split", data.train_split)
    if data.eval_split is None:
        return _carve(train_keys, data)
    if _held_out_file(data):
        if dataset_source(data.dataset) == "local" and os.path.samefile(data.eval_split, data.dataset):
            raise DataError(
                f"data.eval_split={data.eval_split!r} is the training file itself; leave data.eval_split unset to "
                "hold out data.eval_fraction of its rows"
            )
        return train_keys, [], f"held-out: {data.eval_split}"
    return _disjoint(train_keys, source.select("data.eval_split", data.eval_split), data)


def _file_examples(path: str, data) -> list[Example]:
    rows = read_local(path)
    if not rows:
        raise DataError(f"data.eval_split={path!r} holds no rows")
    return to_examples(rows, resolve_format(_columns(rows), data, path), path)


def _columns(rows: Sequence[RawRow]) -> set[str]:
    return {column for _, values in rows for column in values}


def _ignored_columns(rows: Sequence[RawRow], fmt: RowFormat) -> str:
    ignored = sorted(_columns(rows) - set(fmt.columns.values()) - {"task"})
    return f"; not used: {', '.join(ignored)}" if ignored else ""


def _carve(keys: list[RowKey], data) -> tuple[list[RowKey], list[RowKey], str]:
    """Hold out ``data.eval_fraction`` of ``keys`` at random (at least 1 when the fraction is not 0
    and 2 rows exist; at most ``data.max_eval_examples``); the rest stay for training, in order."""
    n = len(keys)
    wanted = round(data.eval_fraction * n)
    count = min(max(wanted, 1), data.max_eval_examples, n - 1)
    if data.eval_fraction == 0 or count <= 0:
        why = ("data.eval_fraction=0" if data.eval_fraction == 0 else
               "data.max_eval_examples=0" if data.max_eval_examples == 0 else "a single training row")
        return keys, [], f"held-out: none ({why}): no exact-match metric"
    held = set(random.Random(data.seed).sample(range(n), count))
    cap = f", capped at data.max_eval_examples={data.max_eval_examples}" if count < wanted else ""
    line = (
        f"held-out: {count} of the {n} rows of data.train_split={data.train_split!r}, drawn at random "
        f"(data.eval_fraction={data.eval_fraction}{cap}, data.seed={data.seed}); training on the other {n - count}"
    )
    return [k for i, k in enumerate(keys) if i not in held], [keys[i] for i in sorted(held)], line


def _disjoint(train_keys: list[RowKey], eval_keys: list[RowKey], data) -> tuple[list[RowKey], list[RowKey], str]:
    """Training rows that exclude the held-out ones. An unsliced ``data.train_split`` (``train``)
    loses the held-out rows; slices that overlap are refused."""
    held = set(eval_keys)
    line = f"held-out: data.eval_split={data.eval_split!r} ({len(eval_keys)} rows)"
    overlap = sum(k in held for k in train_keys)
    if not overlap:
        return train_keys, eval_keys, line
    if "[" in data.train_split or "+" in data.train_split:
        raise DataError(
            f"data.train_split={data.train_split!r} and data.eval_split={data.eval_split!r} share {overlap} rows: the "
            "model would be scored on rows it trained on. Make them disjoint (e.g. 'train[:90%]' and 'train[90%:]') "
            "or leave data.eval_split unset to hold out data.eval_fraction of the rows"
        )
    rest = [k for k in train_keys if k not in held]
    if not rest:
        raise DataError(
            f"data.eval_split={data.eval_split!r} holds out every row of data.train_split={data.train_split!r}"
        )
    return rest, eval_keys, f"{line}; training on the other {len(rest)} rows of {data.train_split!r}"


def _held_out_notes(train: list[Example], held_out: list[Example], max_eval_examples: int) -> list[str]:
    notes = []
    if len(held_out) > max_eval_examples:
        notes.append(f"held-out: scoring the first {max_eval_examples} of {len(held_out)} rows "
                     "(data.max_eval_examples)")
    seen = {example.key() for example in train}
    duplicates = sum(example.key() in seen for example in held_out)
    if duplicates:
        notes.append(f"note: {duplicates} held-out rows also occur among the training rows (duplicates in the data)")
    return notes


def _embedded_splits(data) -> Splits:
    check_split_spec(EMBEDDED_DATASET, "data.train_split", data.train_split)
    check_split_spec(EMBEDDED_DATASET, "data.eval_split", data.eval_split)
    splits = synthetic_splits(data.num_train_examples, data.num_eval_examples, data.seed)
    fmt = RowFormat("prompt_completion", {"prompt": "prompt", "answer": "answer"}, data.system_prompt)
    train = [to_example(row, fmt) for row in splits["train"]]
    held_out = [to_example(row, fmt) for row in splits["test"][: data.max_eval_examples]]
    report = [f"data: {EMBEDDED_DATASET} (generated, seed {data.seed}): {len(train)} training rows, "
              f"{len(held_out)} held-out rows unseen in training"]
    return Splits(train, held_out, fmt, report)


# ----------------------------------------------------------------------------------------------
# Encoding: token ids, and labels that are -100 wherever nothing is to be predicted
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# What the recipe calls
# ----------------------------------------------------------------------------------------------


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


def load_tokenizer_and_data(model, data) -> tuple[Any, RecipeData]:
    """The tokenizer and the encoded data of a run, from its ``model`` and ``data`` config sections
    (:class:`hf_accum.recipe.config.ModelSection`, :class:`hf_accum.recipe.config.DataSection`).

    Everything is read, checked and encoded here, before any model is loaded; problems raise
    :class:`DataError` (one line). With ``hf_accum:tiny-llama`` and the user's own data, the
    tokenizer's vocabulary is built from that data. ``RecipeData.report`` says what was done.
    """
    from hf_accum.recipe import modeling

    splits = load_splits(data)
    corpus = None
    if model.name_or_path == modeling.TINY_MODEL and data.dataset != EMBEDDED_DATASET:
        corpus = [text for example in (*splits.train, *splits.held_out) for text in example.texts()]
    tokenizer = modeling.load_tokenizer(model.name_or_path, model.chat_template, model.trust_remote_code, corpus=corpus)
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


def _encoding_notes(train: EncodedSplit, held_out: EncodedSplit | None, data, fmt: RowFormat) -> list[str]:
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


def _tokenizer_notes(tokenizer, train: EncodedSplit, held_out: EncodedSplit | None, built_from_data: bool) -> list[str]:
    from hf_accum.recipe.modeling import SPECIAL_TOKENS, TINY_VOCAB_LIMIT

    splits = [s for s in (train, held_out) if s is not None]
    unknown, tokens = sum(s.unknown for s in splits), sum(s.tokens for s in splits)
    if built_from_data:
        words = len(tokenizer) - len(SPECIAL_TOKENS)
        return [f"tokenizer: word-level, built from the training and held-out rows: {words} words (at most "
                f"{TINY_VOCAB_LIMIT}); <unk> left: {unknown} of {tokens} tokens"]
    if unknown:
        return [f"note: {unknown} of {tokens} tokens of the data are {tokenizer.unk_token} for this tokenizer"]
    return []


# ----------------------------------------------------------------------------------------------
# Held-out metric: exact match of the greedy answer
# ----------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    return " ".join(text.split())


def _as_decoded(tokenizer, text: str) -> str:
    """``text`` as the tokenizer gives it back (the tiny word-level one spaces out punctuation), so a
    generated answer is compared with what the model could have produced."""
    return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True)


@torch.no_grad()
def exact_match(
    model,
    tokenizer,
    examples: Sequence[Example],
    max_new_tokens: int = 16,
    batch_size: int = 32,
    progress: Callable[[Iterable], Iterable] = lambda x: x,
    synced_gpus: bool = False,
) -> dict[str, Any]:
    """Greedy-decode each conversation's prompt; score 1 when the answer matches the last assistant
    message exactly (whitespace-normalised). Returns the overall score and the score per ``task``.

    ``synced_gpus``: every rank calls this with the same examples and keeps running forwards until
    all ranks are done (``generate(synced_gpus=True)``), as a ZeRO-3-partitioned model needs: each
    forward gathers parameters from all ranks."""
    was_training = model.training
    model.eval()
    hits: list[tuple[str, bool]] = []
    samples: list[dict[str, str]] = []
    for start in progress(range(0, len(examples), batch_size)):
        chunk = examples[start : start + batch_size]
        for example, text in zip(chunk, _generate(model, tokenizer, chunk, max_new_tokens, synced_gpus)):
            expected = example.messages[-1]["content"]
            ok = normalize_answer(text) == normalize_answer(_as_decoded(tokenizer, expected))
            hits.append((example.task, ok))
            if len(samples) < 4:
                samples.append({"prompt": example.messages[-2]["content"], "expected": expected, "generated": text})
    model.train(was_training)
    per_task: dict[str, list[bool]] = {}
    for task, ok in hits:
        per_task.setdefault(task, []).append(ok)
    return {
        "exact_match": sum(ok for _, ok in hits) / max(1, len(hits)),
        "per_task": {t: sum(v) / len(v) for t, v in sorted(per_task.items())},
        "examples": len(hits),
        "samples": samples,
    }


def _generate(model, tokenizer, examples: Sequence[Example], max_new_tokens: int, synced_gpus: bool = False) -> list[str]:
    """Batched greedy decoding with left padding (so every prompt ends where generation starts)."""
    prompts = [prompt_ids(tokenizer, example.messages[:-1]) for example in examples]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced_gpus,  # explicit: left None, generate syncs whenever a ZeRO-3 config is alive
    )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)

