"""The typed recipe config: layers (built-in defaults < YAML < command line), validation, the saved copy.

This module owns the *shape* of a recipe run and every check that can be made before a model
is loaded. A config has recipe fields plus sections; the sections are ONE registry, the
:class:`RecipeConfig` fields whose metadata holds a :class:`Section`::

    engine: loop                # a name from the recipe's engine table (loop | trainer)
    global_batch_size: 32       # optional; derives training.gradient_accumulation_steps
    model:        ModelSection  (this module)
    data:         DataSection   (this module)
    lora:         peft.LoraConfig fields            (null: full fine-tuning)
    quantization: transformers.BitsAndBytesConfig fields (null: none; needs lora -> QLoRA)
    training:     transformers.TrainingArguments fields

Adding a section means adding one such field. The HF sections are not re-declared here: their
keys and types are read from the HF classes themselves (dataclass fields / ``__init__``
signature), values are type-checked against those annotations, and the objects are built by the
HF constructors (which add their own checks).

Layers, lowest first, each remembered as the *source* of the keys it sets (errors name it):

1. built-in defaults: the dataclass defaults and :data:`BUILTIN_DEFAULTS` (sensible for a real
   fine-tune: LoRA on every linear layer, bf16 off, TrainingArguments' own defaults otherwise);
2. the YAML: ``--config FILE``, or :data:`EMBEDDED_DEFAULT` (= ``recipes/configs/cpu_default.yaml``)
   when no ``--config`` is given -- the tiny CPU job;
3. the command line: dotted keys, in either form::

       --training.learning_rate 1e-4     --lora.r=16     training.max_steps=5     --lora null

   values are parsed as YAML (``[q_proj, v_proj]``, ``null``, ``true``), then coerced to the
   field's type (so ``1e-4`` is a float even though YAML 1.1 reads it as a string).

Two rules keep the layers from mixing what belongs together:

* a layer that sets ``data.dataset`` (or ``model.name_or_path``) to something new starts that
  section afresh: the lower layer's data settings (splits, columns, sizes) described *its*
  dataset, not this one;
* ``training.gradient_accumulation_steps`` and ``global_batch_size`` both fix the accumulation:
  the higher layer wins (logged); set in the same layer, they must agree.
"""

from __future__ import annotations

import copy
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
BUILTIN = "built-in default"
COMMAND_LINE = "command line"
EMBEDDED_SOURCE = "embedded default (recipes/configs/cpu_default.yaml)"
# Recipe-level defaults that differ from the HF classes' own defaults.
BUILTIN_DEFAULTS: dict[str, Any] = {
    "engine": "loop",
    "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"},
    "training": {"report_to": "none", "logging_steps": 10},
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
# Keys whose new value makes the lower layers' settings of the same section meaningless.
SECTION_IDENTITY = {"data": "dataset", "model": "name_or_path"}


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
    """The data of a run (:func:`hf_accum.recipe.data.load_tokenizer_and_data` reads it). These defaults are
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


@dataclass(frozen=True)
class Section:
    """A config section: where its keys and types come from, and the object it becomes.

    Either a dataclass of this module (``recipe_class``: model, data) or an HF class named
    ``"module:Class"`` (``hf_class``: lora, quantization, training), whose keys and types are read
    from the class itself. ``nullable``: ``null`` switches the feature off. ``fixed``: values the
    recipe always passes to the HF constructor. ``type_overrides``: keys the recipe reads with a wider
    type than the class declares.
    """

    recipe_class: type | None = None
    hf_class: str | None = None
    nullable: bool = False
    fixed: dict = field(default_factory=dict)
    type_overrides: dict = field(default_factory=dict)

    def cls(self) -> type:
        if self.recipe_class is not None:
            return self.recipe_class
        import importlib

        module, _, name = self.hf_class.partition(":")
        return getattr(importlib.import_module(module), name)

    def types(self) -> dict[str, Any]:
        return {**field_types(self.cls()), **self.type_overrides}

    def check(self, name: str, raw: Any) -> Any:
        """The section's typed value: a dataclass instance, a checked dict of HF fields, or None."""
        if raw is None and self.nullable:
            return None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{name} must be a mapping of {self.cls().__name__} fields, got {raw!r}")
        types_ = self.types()
        for key in raw:
            if key not in types_ and key in TOP_LEVEL:  # e.g. training.overwrite_output_dir (a 4.x field)
                raise ConfigError(f"unknown key '{name}.{key}': {key} is a top-level key, not part of {name}: "
                                  f"write {key}=... on the command line, or {key}: at the top of the YAML")
            if key not in types_:
                raise _unknown_key(f"{name}.", key, list(types_))
        checked = {key: coerce(value, types_[key], f"{name}.{key}") for key, value in raw.items()}
        return self.recipe_class(**checked) if self.recipe_class is not None else checked

    def build(self, name: str, values: dict[str, Any] | None, **changes: Any):
        """The HF object (its own validation errors become ConfigErrors naming the section)."""
        if values is None:
            return None
        return _construct(name, self.cls(), {**self.fixed, **values, **changes})


def _section(default: Any = None, **spec: Any):
    factory = default if callable(default) else (lambda: copy.deepcopy(default))
    return field(default_factory=factory, metadata={"section": Section(**spec)})


@dataclass
class RecipeConfig:
    engine: str = "loop"
    """A name from the recipe's engine table: loop (hf_accum.train on Accelerate), trainer (AccumTrainer)."""
    global_batch_size: int | None = None
    """Sequences per optimizer update over all processes; derives gradient_accumulation_steps."""
    overwrite_output_dir: bool = False
    """Allow writing into an output dir that holds a *different* run."""
    model: ModelSection = _section(ModelSection, recipe_class=ModelSection)
    data: DataSection = _section(DataSection, recipe_class=DataSection)
    lora: dict | None = _section({}, hf_class="peft:LoraConfig", nullable=True, fixed={"task_type": "CAUSAL_LM"})
    """peft.LoraConfig fields; null = full fine-tuning."""
    quantization: dict | None = _section(None, hf_class="transformers:BitsAndBytesConfig", nullable=True)
    """transformers.BitsAndBytesConfig fields; null = unquantized."""
    training: dict = _section(
        {}, hf_class="transformers:TrainingArguments",
        # true (the latest complete checkpoint in output_dir, Trainer's convention) or a path.
        type_overrides={"resume_from_checkpoint": typing.Optional[typing.Union[bool, str]]},
    )
    """transformers.TrainingArguments fields."""
    sources: dict = field(default_factory=dict, repr=False, compare=False, metadata={"derived": True})
    """Which layer set each dotted key (for messages); not part of the saved config."""
    notes: list = field(default_factory=list, repr=False, compare=False, metadata={"derived": True})
    """Decisions taken while resolving (printed by the recipe); not part of the saved config."""

    # -- derived objects (built by the HF classes themselves) ------------------------------
    def lora_config(self):
        return SECTIONS["lora"].build("lora", self.lora)

    def bnb_config(self):
        return SECTIONS["quantization"].build("quantization", self.quantization)

    def training_arguments(self, **changes):
        return SECTIONS["training"].build("training", self.training, **changes)

    def source(self, dotted: str) -> str:
        """The layer that set ``dotted`` (e.g. ``training.learning_rate``)."""
        return self.sources.get(dotted, BUILTIN)

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if not f.metadata.get("derived")
        }

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"training.learning_rate": 2e-4, ...}`` with scalar values (what trackers store as hyperparameters)."""
        flat: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), inner)
            else:
                flat[prefix] = value if isinstance(value, (int, float, str, bool)) else str(value)

        walk("", self.to_dict())
        return flat

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)


# The section registry: every RecipeConfig field that carries a Section.
SECTIONS: dict[str, Section] = {
    f.name: f.metadata["section"] for f in dataclasses.fields(RecipeConfig) if "section" in f.metadata
}
TOP_LEVEL = [f.name for f in dataclasses.fields(RecipeConfig) if not f.metadata.get("derived")]


# ----------------------------------------------------------------------------------------------
# Keys and types, read from the classes
# ----------------------------------------------------------------------------------------------


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
    return SECTIONS[section].types()


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


def overrides_tree(overrides: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}``; ``section=null`` / ``section={...}`` give a whole section."""
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        head, _, rest = dotted.partition(".")
        if not rest:
            tree[head] = value
            continue
        if head not in SECTIONS:
            raise _unknown_key("", head, list(SECTIONS), what="section")
        if tree.get(head) is None:
            tree[head] = {}
        if not isinstance(tree[head], dict):
            raise ConfigError(f"{head} must be a mapping to override {dotted}")
        sub, _, leaf = rest.partition(".")
        if leaf and sub in section_types(head):
            # e.g. training.gradient_checkpointing_kwargs.use_reentrant: a dict-valued field.
            tree[head].setdefault(sub, {})[leaf] = value
        else:
            tree[head][rest] = value
    return tree


def merge_layers(layers: Sequence[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge ``(source, tree)`` layers, lowest first, into one tree and ``{dotted key: source}``.

    Sections merge key by key; ``null`` switches a nullable section off; a new ``data.dataset`` /
    ``model.name_or_path`` starts its section afresh (see the module docstring).
    """
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        for key, value in layer.items():
            if key not in TOP_LEVEL:
                raise _unknown_key("", key, TOP_LEVEL)
            if key in SECTIONS and isinstance(value, dict):
                _merge_section(tree, sources, key, value, source)
            else:
                tree[key] = copy.deepcopy(value)
                _forget(sources, key)
                sources[key] = source
    return tree, sources


def _merge_section(tree, sources, name: str, values: dict[str, Any], source: str) -> None:
    identity = SECTION_IDENTITY.get(name)
    current = tree.get(name)
    starts_afresh = identity in values and isinstance(current, dict) and values[identity] != current.get(identity)
    if current is None or starts_afresh:
        tree[name] = {}
        _forget(sources, name)
    for key, value in values.items():
        tree[name][key] = copy.deepcopy(value)
        sources[f"{name}.{key}"] = source


def _forget(sources: dict[str, str], prefix: str) -> None:
    for key in [k for k in sources if k == prefix or k.startswith(prefix + ".")]:
        del sources[key]


def build_config(tree: dict[str, Any], sources: dict[str, str] | None = None) -> RecipeConfig:
    """Check keys and types of a raw mapping and return the typed config (no cross-field checks)."""
    hints = typing.get_type_hints(RecipeConfig)
    values: dict[str, Any] = {}
    for key, raw in tree.items():
        if key not in TOP_LEVEL:
            raise _unknown_key("", key, TOP_LEVEL)
        values[key] = SECTIONS[key].check(key, raw) if key in SECTIONS else coerce(raw, hints[key], key)
    return RecipeConfig(**values, sources=dict(sources or {}))


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> RecipeConfig:
    """Built-in defaults < the YAML at ``path`` (the embedded default when None) < ``overrides``;
    typed, not yet validated."""
    yaml_layer = (path, load_yaml(path)) if path else (EMBEDDED_SOURCE, EMBEDDED_DEFAULT)
    layers = [(BUILTIN, BUILTIN_DEFAULTS), yaml_layer, (COMMAND_LINE, overrides_tree(overrides or {}))]
    tree, sources = merge_layers(layers)
    return build_config(tree, sources)


# ----------------------------------------------------------------------------------------------
# Cross-field validation (before any model is loaded)
# ----------------------------------------------------------------------------------------------


def world_size_from_env() -> int:
    """Processes of this launch, as torchrun / accelerate launch announce them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve(
    config: RecipeConfig,
    engines: Sequence[str],
    world_size: int | None = None,
    default_output_dir: str = "outputs/run",
) -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate
    everything that does not need the model. ``engines``: the names of the recipe's engine table.
    Returns a new config; raises ConfigError."""
    config = dataclasses.replace(config, training=dict(config.training), notes=list(config.notes))
    world_size = world_size or world_size_from_env()
    t = config.training
    t.setdefault("output_dir", default_output_dir)
    if config.engine not in engines:
        raise _unknown_key("engine=", config.engine, list(engines), what="value")
    _resolve_batch(config, world_size)
    _check_duration(config)
    _check_precision(config)
    _check_quantization(config)
    _check_data(config.data)
    _check_model(config.model)
    if config.lora is not None:
        config.lora_config()  # peft's own checks (e.g. bias, init options)
    return config


def _layer_rank(source: str) -> int:
    return {BUILTIN: 0, COMMAND_LINE: 2}.get(source, 1)


def _resolve_batch(config: RecipeConfig, world_size: int) -> None:
    """``training.gradient_accumulation_steps`` from ``global_batch_size`` (the higher layer wins when
    both are set; in one layer they must agree). Errors name the layer each value came from."""
    from hf_accum.schedule import plan_global_batch

    t = config.training
    micro = t.get("per_device_train_batch_size", 8)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if key in t and t[key] < 1:
            raise ConfigError(f"training.{key}={t[key]} ({config.source('training.' + key)}) must be >= 1")
    if config.global_batch_size is None:
        return
    given = t.get("gradient_accumulation_steps")
    batch_source = config.source("global_batch_size")
    steps_source = config.source("training.gradient_accumulation_steps")
    if given is not None and _layer_rank(steps_source) > _layer_rank(batch_source):
        config.notes.append(
            f"training.gradient_accumulation_steps={given} ({steps_source}) replaces global_batch_size="
            f"{config.global_batch_size} ({batch_source}): effective batch {micro * given * world_size}"
        )
        config.global_batch_size = None
        return
    try:
        plan = plan_global_batch(config.global_batch_size, micro, world_size)
    except ValueError as exc:
        raise ConfigError(f"{exc} [global_batch_size from {batch_source}]") from exc
    if given is not None and given != plan.accumulation_steps and _layer_rank(steps_source) == _layer_rank(batch_source):
        raise ConfigError(
            f"global_batch_size={config.global_batch_size} with {micro} per device x {world_size} processes needs "
            f"gradient_accumulation_steps={plan.accumulation_steps}, but training.gradient_accumulation_steps={given}; "
            f"both set in {batch_source}: set only one of them"
        )
    if given is not None and given != plan.accumulation_steps:
        config.notes.append(
            f"global_batch_size={config.global_batch_size} ({batch_source}) replaces "
            f"training.gradient_accumulation_steps={given} ({steps_source}): {plan.accumulation_steps} accumulation steps"
        )
    t["gradient_accumulation_steps"] = plan.accumulation_steps


def _check_model(model: ModelSection) -> None:
    from hf_accum.recipe.modeling import ModelError, check_model_source

    try:
        check_model_source(model.name_or_path)
    except ModelError as exc:
        raise ConfigError(str(exc)) from exc


def _check_duration(config: RecipeConfig) -> None:
    """A run must have a length: max_steps > 0, or num_train_epochs > 0 (an untrained model saved
    as a finished run is worse than an error)."""
    t = config.training
    max_steps, epochs = t.get("max_steps", -1), t.get("num_train_epochs", 3.0)
    if max_steps == 0 or max_steps < -1:
        raise ConfigError(f"training.max_steps={max_steps} ({config.source('training.max_steps')}): use a number of "
                          "updates >= 1, or -1 to train for training.num_train_epochs")
    if max_steps == -1 and not epochs > 0:
        raise ConfigError(f"training.num_train_epochs={epochs} ({config.source('training.num_train_epochs')}) must "
                          "be > 0 (or set training.max_steps >= 1)")


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
    from hf_accum.recipe.modeling import bnb_available

    if not bnb_available():
        raise ConfigError("quantization (QLoRA) needs bitsandbytes: pip install 'hf_accum[qlora]'")
    config.bnb_config()


def _check_data(data: DataSection) -> None:
    """What can be checked without reading the data: values, files, split names."""
    from hf_accum.recipe.data import FORMATS, DataError, check_local_file, check_split_spec, dataset_source

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


# Keys that say how to run, not what the run is: a resumed run may set them differently.
NOT_PART_OF_THE_RUN = ("overwrite_output_dir", "training.resume_from_checkpoint")


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting that differs between two saved configs (a different run)."""
    return [line for line in _differences(saved, current) if not line.startswith(NOT_PART_OF_THE_RUN)]


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def load_recipe_config(argv: Sequence[str], engines: Sequence[str]) -> RecipeConfig:
    """The recipe's config from its command line: layers merged, typed and validated (nothing loaded,
    nothing written). The default output dir is ``outputs/<config file name>``."""
    path, overrides = parse_overrides(argv)
    name = os.path.splitext(os.path.basename(path))[0] if path else "cpu_default"
    return resolve(load_config(path, overrides), engines, default_output_dir=os.path.join("outputs", name))
