"""The typed recipe config: YAML, then command-line overrides, validation, and the saved copy.

This module owns the *shape* of a recipe run and every check that can be made before a model
is loaded. A config has recipe fields plus five sections::

    engine: loop                # loop (hf_accum.loop.train) | trainer (hf_accum.AccumTrainer)
    global_batch_size: 32       # optional; derives training.gradient_accumulation_steps
    model:        ModelSection  (this module)
    data:         DataSection   (this module)
    lora:         peft.LoraConfig fields            (null: full fine-tuning)
    quantization: transformers.BitsAndBytesConfig fields (null: none; needs lora -> QLoRA)
    training:     transformers.TrainingArguments fields

The HF sections are not re-declared here: their keys and types are read from the HF classes
themselves (dataclass fields / ``__init__`` signature), values are type-checked against those
annotations, and the objects are built by the HF constructors (which add their own checks).

Precedence: dataclass defaults < recipe defaults (:data:`TRAINING_DEFAULTS`) < YAML < command
line. Overrides are dotted keys, in either form::

    --training.learning_rate 1e-4     --lora.r=16     training.max_steps=5     --lora null

values are parsed as YAML (``[q_proj, v_proj]``, ``null``, ``true``), then coerced to the
field's type (so ``1e-4`` is a float even though YAML 1.1 reads it as a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

RESOLVED_CONFIG_NAME = "resolved_config.yaml"
ENGINES = ("loop", "trainer")
# Recipe-level defaults for TrainingArguments that differ from transformers' own defaults.
TRAINING_DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    # The collators need `prompt_length`, which Trainer would drop (not a forward() argument).
    "remove_unused_columns": False,
    # The recipe saves the adapter/model itself at the end; no intermediate Trainer checkpoints.
    "save_strategy": "no",
    "logging_steps": 10,
}
# TrainingArguments fields the Accelerate loop engine honours; others only matter to `trainer`.
LOOP_TRAINING_FIELDS = {
    "output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "num_train_epochs", "max_steps",
    "lr_scheduler_type", "warmup_steps", "max_grad_norm", "seed", "bf16", "fp16", "use_cpu",
    "logging_steps", "disable_tqdm", "label_smoothing_factor", "dataloader_num_workers",
    "gradient_checkpointing", "activation_checkpointing", "report_to", "remove_unused_columns", "save_strategy",
    "per_device_eval_batch_size", "data_seed",
}


# The embedded default run (no --config): what recipes/configs/cpu_default.yaml spells out
# (a test keeps the two identical). LoRA alone learns slowly on a randomly initialised model,
# so it uses a generous rank on every linear layer and also trains the embeddings and the LM
# head (modules_to_save); the run prints exactly which parameters are trained.
EMBEDDED_DEFAULT: dict[str, Any] = {
    "engine": "loop",
    "global_batch_size": 32,
    "model": {"name_or_path": "hf_accum:tiny-llama", "dtype": "float32"},
    "data": {"dataset": "hf_accum:synthetic-tasks", "eval_split": "test", "max_length": 128, "num_train_examples": 5000,
             "num_eval_examples": 200, "eval_max_new_tokens": 16, "packing": False},
    "lora": {
        "r": 32, "lora_alpha": 64, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "modules_to_save": ["embed_tokens", "lm_head"],
    },
    "quantization": None,
    "training": {
        "per_device_train_batch_size": 8, "learning_rate": 2.0e-3, "weight_decay": 0.0, "num_train_epochs": 3.0,
        "lr_scheduler_type": "cosine", "warmup_steps": 0.05, "max_grad_norm": 1.0,
        "activation_checkpointing": True, "logging_steps": 10, "seed": 0, "use_cpu": True,
    },
}


class ConfigError(ValueError):
    """Anything wrong with the config itself; raised before any model is loaded."""


# ----------------------------------------------------------------------------------------------
# Recipe-owned sections
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelSection:
    name_or_path: str = "hf_accum:tiny-llama"
    """Hub id or local path of a causal LM; ``hf_accum:tiny-llama`` is the embedded default."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16 | auto."""
    attn_implementation: str | None = None
    """e.g. sdpa, eager, flash_attention_2 (None: transformers' default)."""
    chat_template: str | None = None
    """Jinja chat template when the tokenizer has none (or to replace it)."""
    trust_remote_code: bool = False
    config_overrides: dict = field(default_factory=dict)
    """LlamaConfig fields for the embedded tiny model (e.g. num_hidden_layers: 4)."""


@dataclass
class DataSection:
    """The data of a run (:func:`hf_accum.data.load_tokenizer_and_data` reads it). These defaults are
    the ones for the user's own data; the embedded dataset's settings come with it."""

    dataset: str = "hf_accum:synthetic-tasks"
    """A .jsonl/.json/.parquet/.csv file, a ``datasets`` name, or ``hf_accum:synthetic-tasks``."""
    dataset_config: str | None = None
    """``datasets`` config name of a hub dataset (e.g. ``main`` for gsm8k)."""
    format: str = "auto"
    """auto (detected from the columns) | chat | prompt_completion | alpaca | text."""
    train_split: str = "train"
    """Split or slice to train on (``train``, ``train[:90%]``); a local file is one split, ``train``."""
    eval_split: str | None = None
    """Held-out split or slice (``test``, ``train[90%:]``) or a second local file. None: hold out
    ``eval_fraction`` of the training rows. Never overlaps the rows trained on."""
    eval_fraction: float = 0.05
    """Share of the training rows held out when ``eval_split`` is None (at most ``max_eval_examples``
    rows, drawn with ``seed``); 0: no held-out rows."""
    messages_column: str | None = None
    """Column names, None for the format's usual ones: chat ``messages``; prompt_completion ``prompt``
    + ``completion``/``answer``; alpaca ``instruction`` + ``output`` (+ ``input``); text ``text``."""
    prompt_column: str | None = None
    answer_column: str | None = None
    input_column: str | None = None
    """Context joined into the user message after the prompt (alpaca's ``input``)."""
    text_column: str | None = None
    system_prompt: str | None = None
    """System message added to conversations that have none."""
    max_length: int = 512
    """Tokens per example after the chat template; longer ones are truncated (and counted)."""
    packing: bool = False
    """Padding-free packing (both engines): each micro-batch's sequences are concatenated into one
    row with ``position_ids`` restarting per sequence (``hf_accum.batching.PackingCollator``) instead
    of right-padded rows. Same sequences per micro-batch, same targets (loss on answers only), no pad
    tokens computed. Needs an attention implementation that honours restarting ``position_ids``
    (transformers' sdpa/eager/flash_attention_2 for Llama-style models do)."""
    max_eval_examples: int = 200
    """Held-out rows scored by exact match (the first ones; caps the ``eval_fraction`` carve-out)."""
    eval_max_new_tokens: int = 32
    num_train_examples: int = 6000
    """Embedded dataset only: generated training examples."""
    num_eval_examples: int = 200
    """Embedded dataset only: generated held-out examples."""
    seed: int = 0
    """Seed of the embedded dataset's generation and of the ``eval_fraction`` draw."""


SECTIONS = ("model", "data", "lora", "quantization", "training")


@dataclass
class RecipeConfig:
    engine: str = "loop"
    """loop: hf_accum.loop.train on Accelerate; trainer: hf_accum.AccumTrainer."""
    global_batch_size: int | None = None
    """Sequences per optimizer update over all processes; derives gradient_accumulation_steps."""
    overwrite_output_dir: bool = False
    """Allow writing into an output dir that holds a *different* run."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: dict | None = field(default_factory=dict)
    """peft.LoraConfig fields; null = full fine-tuning."""
    quantization: dict | None = None
    """transformers.BitsAndBytesConfig fields; null = unquantized."""
    training: dict = field(default_factory=dict)
    """transformers.TrainingArguments fields."""

    # -- derived objects (built by the HF classes themselves) ------------------------------
    def lora_config(self):
        if self.lora is None:
            return None
        from peft import LoraConfig

        return _construct("lora", LoraConfig, {"task_type": "CAUSAL_LM", **self.lora})

    def bnb_config(self):
        if self.quantization is None:
            return None
        from transformers import BitsAndBytesConfig

        return _construct("quantization", BitsAndBytesConfig, self.quantization)

    def training_arguments(self, **changes):
        from transformers import TrainingArguments

        return _construct("training", TrainingArguments, {**self.training, **changes})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)


# ----------------------------------------------------------------------------------------------
# Keys and types, read from the classes
# ----------------------------------------------------------------------------------------------


def _hf_class(section: str):
    if section == "lora":
        from peft import LoraConfig

        return LoraConfig
    if section == "quantization":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig
    from transformers import TrainingArguments

    return TrainingArguments


def field_types(cls) -> dict[str, Any]:
    """``{name: annotation}`` of the keys ``cls(**kwargs)`` accepts.

    The keys are the ``__init__`` parameters (BitsAndBytesConfig is a dataclass with a
    hand-written ``__init__``, so its dataclass fields are not its keys); the types come from the
    class annotations where they exist, else from the default value (``Any`` when it is None).
    """
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: check keys, not types
        hints = {}
    types_: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        default = param.default
        fallback = type(default) if isinstance(default, (bool, int, float, str)) else Any
        types_[name] = hints.get(name, fallback)
    return types_


def section_types(section: str) -> dict[str, Any]:
    if section == "model":
        return field_types(ModelSection)
    if section == "data":
        return field_types(DataSection)
    return field_types(_hf_class(section))


def _unknown_key(where: str, key: str, valid: Sequence[str], what: str = "key") -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} '{where}{key}'.{hint} Valid {what}s: {', '.join(sorted(valid))}")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """``value`` checked against ``annotation``; strings from the command line are converted.

    Raises ``ConfigError`` naming ``key``, the expected type and the value given.
    """
    try:
        return _coerce(value, annotation)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {value!r} ({type(value).__name__})") from exc


def _coerce(value: Any, ann: Any) -> Any:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if ann is Any or ann is inspect.Parameter.empty:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        # Exact type matches first, so "16" stays a str for Union[str, int] but 16 stays an int.
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: not _matches_exactly(value, a)):
            try:
                return _coerce(value, arg)
            except (TypeError, ValueError):
                continue
        raise TypeError(value)
    if origin is typing.Literal:
        if value in args:
            return value
        raise ValueError(value)
    if ann is type(None):
        if value is None:
            return None
        raise TypeError(value)
    if ann is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise TypeError(value)
    if ann is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return int(value)
        raise TypeError(value)
    if ann is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value)
        raise TypeError(value)
    if ann is str:
        if isinstance(value, str):
            return value
        raise TypeError(value)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return ann(value).value if not isinstance(value, ann) else value.value
    if origin in (list, tuple, set, typing.Sequence) or ann in (list, tuple, set):
        if not isinstance(value, (list, tuple)):
            raise TypeError(value)
        item = args[0] if args else Any
        return [_coerce(v, item) for v in value]
    if origin is dict or ann is dict:
        if not isinstance(value, dict):
            raise TypeError(value)
        return value
    return value  # other classes (AcceleratorConfig, LoftQConfig...): their constructors check


def _matches_exactly(value: Any, ann: Any) -> bool:
    base = typing.get_origin(ann) or ann
    return isinstance(base, type) and isinstance(value, base) and not (base is int and isinstance(value, bool))


def _type_name(ann: Any) -> str:
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def _construct(section: str, cls, values: dict[str, Any]):
    """Build the HF object; its own validation errors become ConfigErrors naming the section."""
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{section}: {exc}") from exc


# ----------------------------------------------------------------------------------------------
# Building a config: defaults < YAML < overrides
# ----------------------------------------------------------------------------------------------


def parse_overrides(argv: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """``(config_path, {dotted.key: value})`` from ``--config X --a.b v --c.d=v e.f=v``."""
    config_path, overrides, i = None, {}, 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"override {arg} has no value (use --{key} VALUE or --{key}=VALUE)")
                raw, i = argv[i + 1], i + 1
        elif "=" in arg:
            key, _, raw = arg.partition("=")
        else:
            raise ConfigError(f"cannot read argument {arg!r}: use --section.key VALUE or section.key=VALUE")
        if key == "config":
            config_path = raw
        else:
            overrides[key] = _parse_scalar(raw)
        i += 1
    return config_path, overrides


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def load_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path!r}")
    with open(path) as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def apply_override(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b] = value`` for ``a.b``; ``section=null`` / ``section={...}`` set a whole section."""
    head, _, rest = dotted.partition(".")
    if not rest:
        tree[head] = value
        return
    if head not in SECTIONS:
        raise _unknown_key("", head, SECTIONS, what="section")
    if tree.get(head) is None:
        tree[head] = {}
    if not isinstance(tree[head], dict):
        raise ConfigError(f"{head} must be a mapping to override {dotted}")
    if "." in rest and head in ("training",) and rest.split(".")[0] in section_types(head):
        # e.g. training.gradient_checkpointing_kwargs.use_reentrant: a dict-valued field.
        sub, _, leaf = rest.partition(".")
        tree[head].setdefault(sub, {})[leaf] = value
        return
    tree[head][rest] = value


def build_config(tree: dict[str, Any]) -> RecipeConfig:
    """Check keys and types of a raw mapping and return the typed config (no cross-field checks)."""
    top = {f.name: f for f in dataclasses.fields(RecipeConfig)}
    for key in tree:
        if key not in top:
            raise _unknown_key("", key, list(top))
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(RecipeConfig)
    for key, raw in tree.items():
        if key in ("model", "data"):
            values[key] = _build_section(key, raw)
        elif key in ("lora", "quantization", "training"):
            values[key] = None if raw is None and key != "training" else _check_hf_section(key, raw)
        else:
            values[key] = coerce(raw, hints[key], key)
    config = RecipeConfig(**values)
    config.training = {**TRAINING_DEFAULTS, **config.training}
    return config


def _build_section(name: str, raw: Any):
    cls = ModelSection if name == "model" else DataSection
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must be a mapping, got {raw!r}")
    types_ = field_types(cls)
    for key in raw:
        if key not in types_:
            raise _unknown_key(f"{name}.", key, list(types_))
    return cls(**{k: coerce(v, types_[k], f"{name}.{k}") for k, v in raw.items()})


def _check_hf_section(name: str, raw: Any) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{name} must be a mapping of {_hf_class(name).__name__} fields, got {raw!r}")
    types_ = section_types(name)
    checked = {}
    for key, value in raw.items():
        if key not in types_:
            raise _unknown_key(f"{name}.", key, list(types_))
        checked[key] = coerce(value, types_[key], f"{name}.{key}")
    return checked


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> RecipeConfig:
    """Defaults, then the YAML at ``path`` (if any), then ``overrides``; typed, not yet validated."""
    import copy

    tree = load_yaml(path) if path else copy.deepcopy(EMBEDDED_DEFAULT)
    for dotted, value in (overrides or {}).items():
        apply_override(tree, dotted, value)
    return build_config(tree)


# ----------------------------------------------------------------------------------------------
# Cross-field validation (before any model is loaded)
# ----------------------------------------------------------------------------------------------


def world_size_from_env() -> int:
    """Processes of this launch, as torchrun / accelerate launch announce them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve(config: RecipeConfig, world_size: int | None = None, default_output_dir: str = "outputs/run") -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate
    everything that does not need the model. Returns a new config; raises ConfigError."""
    config = dataclasses.replace(config, training=dict(config.training))
    world_size = world_size or world_size_from_env()
    t = config.training
    t.setdefault("output_dir", default_output_dir)
    if config.engine not in ENGINES:
        raise _unknown_key("engine=", config.engine, ENGINES, what="value")
    _resolve_batch(config, world_size)
    _check_precision(config)
    _check_quantization(config)
    _check_data(config.data)
    if config.lora is not None:
        config.lora_config()  # peft's own checks (e.g. bias, init options)
    return config


def _resolve_batch(config: RecipeConfig, world_size: int) -> None:
    from hf_accum.schedule import plan_global_batch

    t = config.training
    micro = t.get("per_device_train_batch_size", 8)
    if micro < 1:
        raise ConfigError(f"training.per_device_train_batch_size={micro} must be >= 1")
    if "gradient_accumulation_steps" in t and t["gradient_accumulation_steps"] < 1:
        raise ConfigError(f"training.gradient_accumulation_steps={t['gradient_accumulation_steps']} must be >= 1")
    if config.global_batch_size is None:
        return
    try:
        plan = plan_global_batch(config.global_batch_size, micro, world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    given = t.get("gradient_accumulation_steps")
    if given is not None and given != plan.accumulation_steps:
        raise ConfigError(
            f"global_batch_size={config.global_batch_size} with {micro} per device x {world_size} processes needs "
            f"gradient_accumulation_steps={plan.accumulation_steps}, but training.gradient_accumulation_steps={given}; "
            "set only one of them"
        )
    t["gradient_accumulation_steps"] = plan.accumulation_steps


def bf16_supported(use_cpu: bool) -> bool:
    import torch

    if use_cpu or not torch.cuda.is_available():
        # CPU autocast runs bf16, but TrainingArguments only allows it when use_cpu is explicit.
        return use_cpu
    return torch.cuda.is_bf16_supported()


def _check_precision(config: RecipeConfig) -> None:
    t = config.training
    wants_bf16 = t.get("bf16") or config.model.dtype == "bfloat16"
    if wants_bf16 and not bf16_supported(bool(t.get("use_cpu"))):
        raise ConfigError(
            "bf16 requested (training.bf16 / model.dtype: bfloat16) but this machine has no bf16-capable GPU. "
            "Set training.bf16: false and model.dtype: float32, or training.use_cpu: true for CPU bf16 autocast."
        )
    if t.get("bf16") and t.get("fp16"):
        raise ConfigError("training.bf16 and training.fp16 are both true; pick one")
    if config.model.dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ConfigError(f"model.dtype={config.model.dtype!r}; allowed: float32, bfloat16, float16, auto")


def _check_quantization(config: RecipeConfig) -> None:
    if config.quantization is None:
        return
    if config.lora is None:
        raise ConfigError("quantization needs lora (QLoRA): quantized base weights cannot be fine-tuned directly")
    from hf_accum.modeling import bnb_available

    if not bnb_available():
        raise ConfigError("quantization (QLoRA) needs bitsandbytes: pip install 'hf_accum[qlora]'")
    config.bnb_config()


def _check_data(data: DataSection) -> None:
    """What can be checked without reading the data: values, files, split names."""
    from hf_accum.data import FORMATS, DataError, check_local_file, check_split_spec, dataset_source

    if data.format not in ("auto", *FORMATS):
        raise ConfigError(f"data.format={data.format!r}; allowed: auto, {', '.join(FORMATS)}")
    minimums = {"max_length": 2, "num_train_examples": 1, "num_eval_examples": 0, "max_eval_examples": 0,
                "eval_max_new_tokens": 1}
    for key, minimum in minimums.items():
        if getattr(data, key) < minimum:
            raise ConfigError(f"data.{key}={getattr(data, key)} must be >= {minimum}")
    if not 0 <= data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={data.eval_fraction} must be >= 0 and < 1")
    try:
        if dataset_source(data.dataset) == "local":
            check_local_file(data.dataset)
        check_split_spec(data.dataset, "data.train_split", data.train_split)
        check_split_spec(data.dataset, "data.eval_split", data.eval_split)
    except DataError as exc:
        key = "data.dataset: " if str(exc).startswith("data file") else ""
        raise ConfigError(f"{key}{exc}") from exc


# ----------------------------------------------------------------------------------------------
# The saved copy
# ----------------------------------------------------------------------------------------------


def check_output_dir(config: RecipeConfig) -> None:
    """Refuse an output dir that holds a different run (its saved config differs) or unknown files."""
    out = config.training["output_dir"]
    if config.overwrite_output_dir or not os.path.isdir(out) or not os.listdir(out):
        return
    saved_path = os.path.join(out, RESOLVED_CONFIG_NAME)
    if not os.path.isfile(saved_path):
        raise ConfigError(
            f"output dir {out!r} is not empty and holds no {RESOLVED_CONFIG_NAME} (not a recipe run); "
            "choose another training.output_dir or set overwrite_output_dir: true"
        )
    with open(saved_path) as fh:
        saved = yaml.safe_load(fh) or {}
    diff = _differences(saved, config.to_dict())
    if diff:
        raise ConfigError(
            f"output dir {out!r} holds a different run ({'; '.join(diff[:5])}); choose another "
            "training.output_dir or set overwrite_output_dir: true"
        )


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def save_config(config: RecipeConfig, directory: str) -> str:
    path = os.path.join(directory, RESOLVED_CONFIG_NAME)
    with open(path, "w") as fh:
        fh.write(config.to_yaml())
    return path
