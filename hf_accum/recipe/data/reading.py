"""Reading the user's rows, each with where it came from (``line 17``, ``row 3 of split 'train'``).

Local ``.jsonl`` and ``.json`` files are read here, line by line, so that a malformed line or
invalid UTF-8 is reported with its line number; ``.parquet``, ``.csv`` and ``datasets`` hub names
are read through ``datasets``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator

from hf_accum.errors import InputError
from hf_accum.recipe.embedded import EMBEDDED_DATASET

# Local file types; the value names the ``datasets`` builder for those read through ``datasets``.
LOCAL_SUFFIXES = {".jsonl": None, ".json": None, ".parquet": "parquet", ".csv": "csv"}


class DataError(InputError):
    """Bad data configuration or content; the message is one line naming the file, row or key."""


# A row and where it came from ("line 17", "row 3 of split 'train'"), for error messages.
RawRow = tuple[str, dict[str, Any]]


# What ``data.dataset`` can name, for messages.
SUPPORTED = (f"a local {'/'.join(LOCAL_SUFFIXES)} file, a directory written by datasets' save_to_disk, "
             f"a datasets hub name (e.g. gsm8k, with data.dataset_config=main), or {EMBEDDED_DATASET}")
URL_PREFIXES = ("http://", "https://", "ftp://", "s3://", "gs://", "gcs://", "az://", "abfs://", "hf://")
# The files datasets' save_to_disk writes: a DatasetDict's index, or a Dataset's state.
DATASET_DICT_FILE, DATASET_STATE_FILE = "dataset_dict.json", "state.json"


def dataset_source(name: str) -> str:
    """``embedded``, ``local`` (a file path), ``disk`` (a ``save_to_disk`` directory) or ``hub`` (a
    ``datasets`` name)."""
    if name == EMBEDDED_DATASET:
        return "embedded"
    if os.path.splitext(name)[1] in LOCAL_SUFFIXES or os.path.isfile(name):
        return "local"
    if os.path.isdir(name):
        return "disk"
    return "hub"


def refuse_url(key: str, value: str | None) -> None:
    """A URL is not something the recipe downloads: say what it reads instead."""
    if isinstance(value, str) and value.lower().startswith(URL_PREFIXES):
        raise DataError(f"{key}={value!r}: URLs are not read; download the file first. Supported: {SUPPORTED}")


def check_disk_dir(path: str) -> None:
    """A directory must be one that ``datasets.Dataset(Dict).save_to_disk`` wrote."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in (DATASET_DICT_FILE, DATASET_STATE_FILE)):
        raise DataError(
            f"data.dataset={path!r} is a directory but not one written by datasets' save_to_disk (no "
            f"{DATASET_DICT_FILE} or {DATASET_STATE_FILE}); supported: {SUPPORTED}"
        )


def disk_splits(path: str) -> list[str]:
    """The splits of a ``save_to_disk`` directory: a DatasetDict's, or ``train`` for a single Dataset."""
    index = os.path.join(path, DATASET_DICT_FILE)
    if not os.path.isfile(index):
        return ["train"]
    try:
        with open(index) as handle:
            return list(json.load(handle)["splits"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{index}: not a readable datasets split index ({exc})") from None


def read_disk(path: str, split: str) -> list[RawRow]:
    """Every row of one split of a ``save_to_disk`` directory (``datasets.load_from_disk``)."""
    import datasets

    check_disk_dir(path)
    try:
        loaded = datasets.load_from_disk(path)
    except (datasets.exceptions.DatasetsError, ValueError, KeyError, OSError) as exc:
        raise DataError(f"cannot load {path} with datasets.load_from_disk: {' '.join(str(exc).split())[:300]}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path} has no split {split!r}; its splits: {', '.join(loaded)}")
        loaded = loaded[split]
    elif split != "train":
        raise DataError(f"{path} holds a single Dataset (split 'train'), not {split!r}")
    return [(f"row {i + 1} of split {split!r}", dict(values)) for i, values in enumerate(loaded)]


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


def _load_with_datasets(what: str, *args: Any, **kwargs: Any) -> Any:  # a datasets.Dataset (split given)
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
