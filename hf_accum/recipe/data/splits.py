"""Splits: the training rows and disjoint held-out rows of a dataset.

The held-out rows (the exact-match metric) come from ``data.eval_split`` -- a split or slice of the
same dataset, or a second local file -- or, when it is unset, are carved at random from the
training rows (``data.eval_fraction``, capped at ``data.max_eval_examples``, seeded). Either way no
held-out row is trained on.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from hf_accum.recipe.config import DataSection
from hf_accum.recipe.data.formats import (
    FORMATS,
    PREFERENCE_FORMATS,
    Example,
    RowFormat,
    resolve_format,
    to_example,
    to_examples,
)
from hf_accum.recipe.data.reading import (
    DataError,
    RawRow,
    check_disk_dir,
    check_local_file,
    dataset_source,
    disk_splits,
    read_disk,
    read_hub,
    read_local,
    refuse_url,
)
from hf_accum.recipe.embedded import EMBEDDED_DATASET, synthetic_preference_splits, synthetic_splits

# A row's identity inside its dataset: (unsliced split name, index).
RowKey = tuple[str, int]


def split_names(spec: str) -> list[str]:
    """The unsliced splits a split spec reads: ``"train[:90%]+test"`` -> ``["train", "test"]``."""
    return [part.split("[", 1)[0].strip() for part in spec.split("+")]


def check_split_spec(dataset: str, key: str, spec: str | None) -> None:
    """Refuse, before anything is loaded, a split that cannot be read from ``dataset``."""
    if spec is None:
        return
    refuse_url(key, spec)
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
    if dataset_source(dataset) == "disk":
        check_disk_dir(dataset)
        missing = [name for name in split_names(spec) if name not in disk_splits(dataset)]
        if missing:
            raise DataError(f"{key}={spec!r}: {dataset} has no split {missing[0]!r}; its splits: "
                            f"{', '.join(disk_splits(dataset))}")
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
            self._splits[name] = self._read(name)
        return self._splits[name]

    def _read(self, split: str) -> list[RawRow]:
        source = dataset_source(self.name)
        if source == "local":
            return read_local(self.name)
        if source == "disk":
            return read_disk(self.name, split)
        return read_hub(self.name, split, self.config_name)

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


def load_splits(data: DataSection, formats: Sequence[str] = FORMATS) -> Splits:
    """Training and held-out examples for a :class:`hf_accum.recipe.config.DataSection`; every row checked.
    ``formats``: the formats detected (:data:`~hf_accum.recipe.data.formats.PREFERENCE_FORMATS` for DPO).

    Held-out rows: ``data.eval_split`` (a split or slice of ``data.dataset``, or a second local
    file), else ``data.eval_fraction`` of the training rows carved at random (seeded by
    ``data.seed``, at most ``data.max_eval_examples``). They are never trained on.
    """
    if data.dataset == EMBEDDED_DATASET:
        return _embedded_splits(data, preference=formats == PREFERENCE_FORMATS)
    check_split_spec(data.dataset, "data.train_split", data.train_split)
    check_split_spec(data.dataset, "data.eval_split", data.eval_split)
    source = DatasetRows(data.dataset, data.dataset_config)
    train_keys, eval_keys, held_out_line = _choose_rows(source, data)
    # The rows of one dataset are checked together, so that one message counts every bad row.
    chosen = sorted(set(train_keys) | set(eval_keys))
    rows = source.rows(chosen)
    fmt = resolve_format(_columns(rows), data, data.dataset, formats)
    examples = dict(zip(chosen, to_examples(rows, fmt, data.dataset)))
    train, held_out = [examples[k] for k in train_keys], [examples[k] for k in eval_keys]
    if _held_out_file(data):
        assert data.eval_split is not None  # _held_out_file
        held_out = _file_examples(data.eval_split, data, formats)
        held_out_line += f" ({len(held_out)} rows)"
    report = [f"data: {data.dataset}: format {fmt.describe()}{_ignored_columns(rows, fmt)}", held_out_line]
    report += _held_out_notes(train, held_out, data.max_eval_examples)
    return Splits(train, held_out[: data.max_eval_examples], fmt, report)


def _held_out_file(data: DataSection) -> bool:
    return data.eval_split is not None and dataset_source(data.eval_split) == "local"


def _choose_rows(source: DatasetRows, data: DataSection) -> tuple[list[RowKey], list[RowKey], str]:
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


def _file_examples(path: str, data: DataSection, formats: Sequence[str]) -> list[Example]:
    rows = read_local(path)
    if not rows:
        raise DataError(f"data.eval_split={path!r} holds no rows")
    return to_examples(rows, resolve_format(_columns(rows), data, path, formats), path)


def _columns(rows: Sequence[RawRow]) -> set[str]:
    return {column for _, values in rows for column in values}


def _ignored_columns(rows: Sequence[RawRow], fmt: RowFormat) -> str:
    ignored = sorted(_columns(rows) - set(fmt.columns.values()) - {"task"})
    return f"; not used: {', '.join(ignored)}" if ignored else ""


def _carve(keys: list[RowKey], data: DataSection) -> tuple[list[RowKey], list[RowKey], str]:
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


def _disjoint(train_keys: list[RowKey], eval_keys: list[RowKey],
              data: DataSection) -> tuple[list[RowKey], list[RowKey], str]:
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


def _embedded_splits(data: DataSection, preference: bool = False) -> Splits:
    """The synthetic tasks; with ``preference``, as pairs: the right answer chosen, a corrupted one rejected."""
    check_split_spec(EMBEDDED_DATASET, "data.train_split", data.train_split)
    check_split_spec(EMBEDDED_DATASET, "data.eval_split", data.eval_split)
    if preference:
        splits = synthetic_preference_splits(data.num_train_examples, data.num_eval_examples, data.seed)
        fmt = RowFormat("preference", {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
                        data.system_prompt)
    else:
        splits = synthetic_splits(data.num_train_examples, data.num_eval_examples, data.seed)
        fmt = RowFormat("prompt_completion", {"prompt": "prompt", "answer": "answer"}, data.system_prompt)
    train = [to_example(row, fmt) for row in splits["train"]]
    held_out = [to_example(row, fmt) for row in splits["test"][: data.max_eval_examples]]
    what = "preference pairs (the right answer chosen, a corrupted one rejected)" if preference else "rows"
    report = [f"data: {EMBEDDED_DATASET} (generated, seed {data.seed}): {len(train)} training {what}, "
              f"{len(held_out)} held-out {what.split(' (')[0]} unseen in training"]
    return Splits(train, held_out, fmt, report)
