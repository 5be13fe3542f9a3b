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
