"""Datasets for the recipes: loading, chat templates, prompt masking, and the embedded default.

This module owns:

* the **embedded default dataset** (``hf_accum:synthetic-tasks``): instruction examples generated
  deterministically from a seed -- copy, reverse, table lookup and "last word" tasks whose
  prompt *and* answer lengths vary strongly, so that accumulation over uneven micro-batches is
  exercised -- with a held-out split and its metric (exact match of the greedy answer);
* loading user data: local ``.jsonl``/``.json``/``.parquet`` files or ``datasets`` hub names;
* turning rows into token ids with the tokenizer's chat template, with ``prompt_length`` set so
  that the collators in :mod:`hf_accum.batching` put the loss on the answer only, and counting
  how many examples the length limit truncated.

A row is either ``{"prompt": str, "answer": str}`` or ``{"messages": [{"role", "content"}...]}``
(the last message is the answer). Column names are configurable (:class:`hf_accum.config.DataSection`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

EMBEDDED_DATASET = "hf_accum:synthetic-tasks"
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

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
# Loading rows
# ----------------------------------------------------------------------------------------------


class DataError(ValueError):
    """Bad data configuration or content (missing files, empty splits, missing columns)."""


def dataset_source(name: str) -> str:
    """``embedded``, ``local`` (a file path) or ``hub`` (a ``datasets`` name)."""
    if name == EMBEDDED_DATASET:
        return "embedded"
    if os.path.splitext(name)[1] in LOCAL_SUFFIXES or os.sep in name and os.path.exists(name):
        return "local"
    return "hub"


def check_local_file(path: str) -> None:
    """Fail fast (before any model is loaded) on a missing or empty local data file."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path!r} (cwd: {os.getcwd()})")
    if os.path.getsize(path) == 0:
        raise DataError(f"data file is empty: {path!r}")


def load_split(dataset: str, split: str) -> list[dict[str, Any]]:
    """Rows of ``split`` of ``dataset``; ``split`` may itself be a local file (a separate eval file)."""
    if dataset_source(split) == "local":
        return load_rows(split, "train")
    return load_rows(dataset, split)


def load_rows(name: str, split: str, data_kwargs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rows of ``split`` from a local file (jsonl/json/parquet) or a ``datasets`` name.

    A local file has a single split, ``train``, which may be sliced (``train[:90%]``).
    """
    import datasets

    source = dataset_source(name)
    kwargs = dict(data_kwargs or {})
    try:
        if source == "local":
            check_local_file(name)
            builder = LOCAL_SUFFIXES[os.path.splitext(name)[1]]
            if not split.startswith("train"):
                # A local file is a single split named "train"; silently reusing it as the
                # held-out split would score the model on its own training data.
                raise DataError(
                    f"{name!r} is a single local file: use a slice such as 'train[:90%]' / 'train[90%:]' "
                    f"or a second file as the split, not {split!r}"
                )
            ds = datasets.load_dataset(builder, data_files={"train": name}, split=split, **kwargs)
        else:
            ds = datasets.load_dataset(name, split=split, **kwargs)
    except DataError:
        raise
    except (ValueError, FileNotFoundError, ConnectionError, KeyError) as exc:
        # datasets says "corresponds to no data" for empty files; unknown names/splits land here too.
        raise DataError(f"cannot load dataset {name!r} split {split!r}: {exc}") from exc
    rows = list(ds)
    if not rows:
        raise DataError(f"dataset {name!r} split {split!r} is empty")
    return rows


# ----------------------------------------------------------------------------------------------
# Rows -> chat messages -> token ids with prompt_length
# ----------------------------------------------------------------------------------------------


@dataclass
class Columns:
    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"
    system_prompt: str | None = None


def to_messages(row: dict[str, Any], columns: Columns) -> list[dict[str, str]]:
    """A row as chat messages whose last message is the assistant's answer."""
    if columns.messages in row and row[columns.messages]:
        messages = [dict(role=m["role"], content=m["content"]) for m in row[columns.messages]]
        if messages[-1]["role"] != "assistant":
            raise DataError(f"the last message must be the assistant's answer, got role {messages[-1]['role']!r}")
        return messages
    missing = [c for c in (columns.prompt, columns.answer) if c not in row]
    if missing:
        raise DataError(
            f"row has neither a {columns.messages!r} column nor {missing} (columns: {sorted(row)}); "
            "set data.prompt_column / data.answer_column / data.messages_column"
        )
    messages = [{"role": "user", "content": str(row[columns.prompt])}, {"role": "assistant", "content": str(row[columns.answer])}]
    if columns.system_prompt:
        messages.insert(0, {"role": "system", "content": columns.system_prompt})
    return messages


def prompt_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the conversation up to (and including) the assistant header."""
    return list(tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True, return_dict=False))


def encode(tokenizer, messages: Sequence[dict[str, str]], max_length: int) -> tuple[dict[str, Any], bool]:
    """``({"input_ids", "prompt_length"}, truncated)``. Loss goes on the answer only: the
    collators mask the first ``prompt_length`` labels."""
    prompt = prompt_ids(tokenizer, messages[:-1])
    full = list(tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False))
    if full[: len(prompt)] != prompt:
        # A template that renders the prompt differently once the answer follows would misplace
        # the mask; refuse rather than train on the wrong tokens.
        raise DataError("chat template renders the prompt differently with and without the answer")
    truncated = len(full) > max_length
    return {"input_ids": full[:max_length], "prompt_length": min(len(prompt), max_length)}, truncated


@dataclass
class EncodedSplit:
    examples: list[dict[str, Any]]
    truncated: int
    dropped: int

    def summary(self) -> str:
        return f"{len(self.examples)} examples ({self.truncated} truncated, {self.dropped} dropped: no answer token left)"


def encode_rows(tokenizer, rows: Iterable[dict[str, Any]], columns: Columns, max_length: int) -> EncodedSplit:
    """Encode rows; count truncations; drop rows whose answer was truncated away entirely
    (they would add no target and only waste compute)."""
    examples, truncated, dropped = [], 0, 0
    for row in rows:
        example, was_truncated = encode(tokenizer, to_messages(row, columns), max_length)
        truncated += was_truncated
        if example["prompt_length"] >= len(example["input_ids"]):
            dropped += 1
            continue
        examples.append(example)
    if not examples:
        raise DataError(f"no usable training example left (all {dropped} truncated before the answer); raise data.max_length")
    return EncodedSplit(examples, truncated, dropped)


# ----------------------------------------------------------------------------------------------
# Held-out metric: exact match of the greedy answer
# ----------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    return " ".join(text.split())


@torch.no_grad()
def exact_match(
    model,
    tokenizer,
    rows: Sequence[dict[str, Any]],
    columns: Columns,
    max_new_tokens: int = 16,
    batch_size: int = 32,
    progress: Callable[[Iterable], Iterable] = lambda x: x,
) -> dict[str, Any]:
    """Greedy-decode each prompt; score 1 when the answer matches exactly (whitespace-normalised).

    Returns the overall score and the score per ``task`` column when rows have one.
    """
    was_training = model.training
    model.eval()
    hits: list[tuple[str, bool]] = []
    samples: list[dict[str, str]] = []
    for start in progress(range(0, len(rows), batch_size)):
        chunk = rows[start : start + batch_size]
        for row, text in zip(chunk, _generate(model, tokenizer, chunk, columns, max_new_tokens)):
            messages = to_messages(row, columns)
            ok = normalize_answer(text) == normalize_answer(messages[-1]["content"])
            hits.append((str(row.get("task", "all")), ok))
            if len(samples) < 4:
                samples.append({"prompt": messages[-2]["content"], "expected": messages[-1]["content"], "generated": text})
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


def _generate(model, tokenizer, rows, columns: Columns, max_new_tokens: int) -> list[str]:
    """Batched greedy decoding with left padding (so every prompt ends where generation starts)."""
    prompts = [prompt_ids(tokenizer, to_messages(row, columns)[:-1]) for row in rows]
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
    )
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# The recipe's data, from its config
# ----------------------------------------------------------------------------------------------


@dataclass
class RecipeData:
    train: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    columns: Columns
    summary: str
    facts: dict[str, Any]
    eval_examples: list[dict[str, Any]]


def load_tokenizer_and_data(model_section, data_section):
    """The tokenizer and the encoded training examples (chat template applied, loss on the answer
    only, truncation counted), plus the held-out rows for the metric."""
    from hf_accum.modeling import load_tokenizer

    m, d = model_section, data_section
    tokenizer = load_tokenizer(m.name_or_path, m.chat_template, m.trust_remote_code)
    columns = Columns(d.prompt_column, d.answer_column, d.messages_column, d.system_prompt)
    if d.dataset == EMBEDDED_DATASET:
        splits = synthetic_splits(d.num_train_examples, d.num_eval_examples, d.seed)
        train_rows, eval_rows = splits["train"], splits.get(d.eval_split or "", [])
    else:
        train_rows = load_split(d.dataset, d.train_split)
        eval_rows = load_split(d.dataset, d.eval_split) if d.eval_split else []
    train = encode_rows(tokenizer, train_rows, columns, d.max_length)
    eval_rows = eval_rows[: d.max_eval_examples]
    summary = f"data: {d.dataset} train {train.summary()}; held-out {len(eval_rows)} examples"
    facts = {"train_examples": len(train.examples), "truncated": train.truncated, "dropped": train.dropped,
             "eval_examples": len(eval_rows)}
    held_out = encode_rows(tokenizer, eval_rows, columns, d.max_length).examples if eval_rows else []
    return tokenizer, RecipeData(train.examples, eval_rows, columns, summary, facts, held_out)
