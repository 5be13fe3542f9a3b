"""The shape of a recipe config: ONE section registry (the :class:`RecipeConfig` fields carrying a
:class:`Section`), each key's type read from its class and values coerced by pydantic, and the saved copy.

A value of the annotated type passes as is (pydantic strict mode); a string from the command line is converted
(lax mode: ``"1e-4"`` -> 1e-4, ``"true"`` -> True); anything else is one line naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import importlib
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

from hf_accum.errors import InputError
from hf_accum.recipe.accumulation_section import check_accumulation_section
from hf_accum.recipe.config.sections import (
    AccumulationSection,
    DataSection,
    DPOSection,
    ModelSection,
    TrainingSection,
)
from hf_accum.recipe.data import check_data_section
from hf_accum.recipe.modeling import check_model_section, check_quantization_section
from hf_accum.recipe.preference_section import check_dpo_section

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


class ConfigError(InputError):
    """Anything wrong with the config itself; raised before any model is loaded."""


@dataclass(frozen=True)
class Section:
    """A config section: its keys and types (the ``__init__`` of ``recipe_class``, a dataclass, or of ``hf_class``,
    ``"module:Class"`` imported when needed: its values stay a ``container``). ``nullable``: ``null`` switches it
    off. ``fixed``: always passed to the HF constructor. ``type_overrides``: keys read wider than the class
    declares. ``validator(value, config)``: the owner's check of what values mean. ``identity`` / ``tied``: a
    higher layer's new ``identity`` value drops the lower layers' ``tied`` keys, each named in a note.
    """

    recipe_class: type | None = None
    hf_class: str | None = None
    nullable: bool = False
    fixed: dict = field(default_factory=dict)
    type_overrides: dict = field(default_factory=dict)
    validator: Callable[[Any, Any], None] | None = None
    container: type = dict
    identity: str | None = None
    tied: tuple[str, ...] = ()

    def cls(self) -> type:
        if self.recipe_class is not None:
            return self.recipe_class
        module, _, name = str(self.hf_class).partition(":")
        return getattr(importlib.import_module(module), name)

    def types(self) -> dict[str, Any]:
        return {**field_types(self.cls()), **self.type_overrides}

    def check(self, name: str, raw: Any) -> Any:
        """The section's typed value: a dataclass instance, a checked mapping of HF fields, or None."""
        if raw is None and self.nullable:
            return None
        if not isinstance(raw if raw is not None else {}, dict):
            raise ConfigError(f"{name} must be a mapping of {self.cls().__name__} fields, got {raw!r}")
        types_ = self.types()
        for key in raw or {}:
            if key not in types_ and key in TOP_LEVEL:  # e.g. training.overwrite_output_dir (a 4.x field)
                raise ConfigError(f"unknown key '{name}.{key}': {key} is a top-level key, not part of {name}: "
                                  f"write {key}=... on the command line, or {key}: at the top of the YAML")
            if key not in types_:
                raise unknown_key(f"{name}.", key, list(types_))
        checked = {key: coerce(value, types_[key], f"{name}.{key}") for key, value in (raw or {}).items()}
        return self.recipe_class(**checked) if self.recipe_class is not None else self.container(checked)

    def build(self, name: str, values: dict[str, Any] | None, **changes: Any):
        """The HF object; its own refusal (TypeError/ValueError) becomes a ConfigError naming the section."""
        if values is None:
            return None
        try:
            return self.cls()(**{**self.fixed, **values, **changes})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: {' '.join(str(exc).split())}") from exc


def _section(default: Any = None, **spec: Any):
    factory = default if callable(default) else (lambda: copy.deepcopy(default))
    return field(default_factory=factory, metadata={"section": Section(**spec)})


@dataclass
class RecipeConfig:
    engine: str = "loop"
    """A name from the recipe's engine table: loop (hf_accum.train on Accelerate), trainer (AccumTrainer)."""
    objective: str = "sft"  # objective: dpo (issue 25 item 4); its section: `dpo` below
    """What is trained: sft (the answers' tokens) | dpo (preference pairs; the ``dpo`` section)."""
    global_batch_size: int | None = None
    """Sequences per optimizer update over all processes; derives gradient_accumulation_steps."""
    overwrite_output_dir: bool = False
    """Allow writing into an output dir that holds a *different* run."""
    model: ModelSection = _section(ModelSection, recipe_class=ModelSection, validator=check_model_section,
                                   identity="name_or_path", tied=ModelSection.TIED)
    data: DataSection = _section(DataSection, recipe_class=DataSection, validator=check_data_section,
                                 identity="dataset", tied=DataSection.TIED)
    accumulation: AccumulationSection = _section(AccumulationSection, recipe_class=AccumulationSection,
                                                 validator=check_accumulation_section)
    dpo: DPOSection = _section(DPOSection, recipe_class=DPOSection, validator=check_dpo_section)
    """DPO's settings (``objective: dpo``): beta, loss_type, label_smoothing, sft_weight."""
    lora: dict | None = _section({}, hf_class="peft:LoraConfig", nullable=True, fixed={"task_type": "CAUSAL_LM"})
    """peft.LoraConfig fields; null = full fine-tuning."""
    quantization: dict | None = _section(None, hf_class="transformers:BitsAndBytesConfig", nullable=True,
                                         validator=check_quantization_section)
    """transformers.BitsAndBytesConfig fields; null = unquantized."""
    training: TrainingSection = _section(
        TrainingSection, hf_class="transformers:TrainingArguments", container=TrainingSection,
        # resume: true (the latest complete checkpoint in output_dir, Trainer's convention) or a path; fsdp: true.
        type_overrides={"resume_from_checkpoint": bool | str | None, "fsdp": bool | str | list[str] | None},
    )
    """transformers.TrainingArguments fields."""
    sources: dict = field(default_factory=dict, repr=False, compare=False, metadata={"derived": True})
    """Which layer set each dotted key (for messages); not part of the saved config."""
    notes: list = field(default_factory=list, repr=False, compare=False, metadata={"derived": True})
    """Decisions taken while merging and resolving (printed by the recipe); not part of the saved config."""

    def lora_config(self):
        return SECTIONS["lora"].build("lora", self.lora)

    def bnb_config(self):
        return SECTIONS["quantization"].build("quantization", self.quantization)

    def training_arguments(self, **changes):
        return SECTIONS["training"].build("training", self.training, **changes)

    def source(self, dotted: str) -> str:
        """The layer that set ``dotted`` (e.g. ``training.learning_rate``)."""
        return self.sources.get(dotted, BUILTIN)

    def layer_rank(self, dotted: str) -> int:
        """0: built in; 1: the YAML (a file or the embedded default); 2: the command line."""
        return {BUILTIN: 0, COMMAND_LINE: 2}.get(self.source(dotted), 1)

    def to_dict(self) -> dict[str, Any]:
        fields = [f.name for f in dataclasses.fields(self) if not f.metadata.get("derived")]
        return {name: _saved(getattr(self, name)) for name in fields}

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"training.learning_rate": 2e-4, ...}`` with scalar values (what trackers store as hyperparameters)."""
        return _flat(self.to_dict())

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree if isinstance(tree, (int, float, str, bool)) else str(tree)}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}.{key}" if prefix else key).items()}


def _saved(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(copy.deepcopy(value)) if isinstance(value, dict) else copy.deepcopy(value)


# The section registry: every RecipeConfig field that carries a Section.
SECTIONS: dict[str, Section] = {
    f.name: f.metadata["section"] for f in dataclasses.fields(RecipeConfig) if "section" in f.metadata
}
TOP_LEVEL = [f.name for f in dataclasses.fields(RecipeConfig) if not f.metadata.get("derived")]


def unknown_key(where: str, key: str, valid: Sequence[str], what: str = "key") -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} '{where}{key}'.{hint} Valid {what}s: {', '.join(sorted(valid))}")


# Keys and types read from the classes; values coerced by pydantic.


def field_types(cls) -> dict[str, Any]:
    """``{name: annotation}`` of the keys ``cls(**kwargs)`` accepts: the ``__init__`` parameters (BitsAndBytesConfig's
    hand-written ``__init__`` differs from its dataclass fields), typed by the class annotations, else by the
    default's type (``Any`` when it is None or the annotations cannot be resolved)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: check keys, not types
        hints = {}
    types_: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        default = param.default
        types_[name] = hints.get(name, type(default) if isinstance(default, (bool, int, float, str)) else Any)
    return types_


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """``value`` checked against ``annotation`` (pydantic strict), a command-line string converted (lax);
    ConfigError naming ``key``, the expected type and the value given."""
    if annotation is Any:
        return value
    adapter, error = _adapter(annotation), None
    # YAML 1.1 reads an unquoted no (save_strategy: no) as false.
    for candidate in (value, "no") if value is False else (value,):
        try:
            return _plain(adapter.validate_python(candidate, strict=True))
        except ValidationError as exc:
            error = error or exc
    if isinstance(value, str):
        try:
            return _plain(adapter.validate_python(value))
        except ValidationError as exc:
            error = exc
    name = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
    why = "; ".join(dict.fromkeys(e["msg"] for e in error.errors())) if error is not None else "not accepted"
    raise ConfigError(f"{key}: expected {name}, got {value!r} ({type(value).__name__}): {why}")


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter:
    try:
        return TypeAdapter(annotation, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # a dataclass or model (own config), or a type pydantic cannot describe: its constructor checks
        try:
            return TypeAdapter(annotation)
        except Exception:
            return TypeAdapter(Any)


def _plain(value: Any) -> Any:
    """Values as YAML saves them: enum members as their values, tuples and sets as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# The saved copy.

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
