"""The shape of a recipe config: ONE section registry (the :class:`RecipeConfig` fields carrying a
:class:`Section`), each key's type read from its class, values coerced by pydantic, and the saved copy.

The schema knows each section's keys, types and documentation, never what a value means: the modules that own a
meaning import the config and check it (:mod:`hf_accum.recipe.checks` runs their checks). So reading a config
imports no component and no torch.

Coercion (:func:`coerce`, a pydantic ``TypeAdapter`` per annotation): a value of the annotated type passes as is
(strict mode); a string, as the command line gives, is converted (lax mode: ``"1e-4"`` -> 1e-4, ``"true"`` -> True);
anything else is one line naming the key, the type expected and pydantic's reason.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml
from pydantic import PydanticSchemaGenerationError, TypeAdapter, ValidationError

from hf_accum.errors import InputError
from hf_accum.recipe.command_line import ConfigError
from hf_accum.recipe.config.grpo import GRPOSection
from hf_accum.recipe.config.sections import (
    AccumulationSection,
    DataSection,
    DPOSection,
    ModelSection,
    TrainingSection,
)

RESOLVED_CONFIG_NAME = "resolved_config.yaml"
BUILTIN, COMMAND_LINE = "built-in default", "command line"
# Keys that say how to run, not what the run is: a resumed run may set them differently.
NOT_PART_OF_THE_RUN = ("overwrite_output_dir", "training.resume_from_checkpoint")


@dataclass(frozen=True)
class Section:
    """A config section. Its keys and types are the ``__init__`` parameters of ``kind``: a recipe dataclass (the
    section's value is an instance), or an HF class named ``"module:Class"``, imported when needed (the value stays a
    ``container`` mapping of the keys set). ``nullable``: ``null`` switches it off. ``fixed``: always passed to the
    HF constructor. ``type_overrides``: keys read wider than the class declares. What the values mean is checked
    by the module that owns that meaning (:mod:`hf_accum.recipe.checks`), not here."""

    kind: type | str
    nullable: bool = False
    fixed: dict[str, Any] = field(default_factory=dict)
    type_overrides: dict[str, Any] = field(default_factory=dict)
    container: type[dict[str, Any]] = dict

    def cls(self) -> type:
        if isinstance(self.kind, type):
            return self.kind
        module, _, name = self.kind.partition(":")
        return typing.cast(type, getattr(importlib.import_module(module), name))

    def types(self) -> dict[str, Any]:
        return {**field_types(self.cls()), **self.type_overrides}

    def check(self, name: str, raw: Any) -> Any:
        """The section's typed value: a recipe dataclass instance, a checked mapping of HF fields, or None."""
        if raw is None and self.nullable:
            return None
        if not isinstance(raw if raw is not None else {}, dict):
            raise ConfigError(f"{name} must be a mapping of {self.cls().__name__} fields, got {raw!r}")
        values = checked(f"{name}.", raw or {}, self.types())
        if not isinstance(self.kind, type):
            return self.container(values)
        try:
            return self.kind(**values)
        except ConfigError:
            raise
        except InputError as exc:  # a section that checks its own values when built: still a config error
            raise ConfigError(str(exc)) from exc

    def build(self, name: str, values: dict[str, Any] | None, **changes: Any) -> Any:
        """The HF object; its own refusal (TypeError/ValueError) becomes a ConfigError naming the section."""
        if values is None:
            return None
        try:
            return self.cls()(**{**self.fixed, **values, **changes})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: {' '.join(str(exc).split())}") from exc


def _section(kind: type | str, default: Any = None, **spec: Any) -> Any:
    """A :class:`RecipeConfig` field carrying its :class:`Section` (a recipe dataclass defaults to its defaults)."""
    factory = kind if isinstance(kind, type) else functools.partial(copy.deepcopy, default)
    return field(default_factory=factory, metadata={"section": Section(kind, **spec)})


@dataclass
class RecipeConfig:
    engine: str = "loop"
    """A name from the recipe's engine table: loop (hf_accum.train on Accelerate), trainer (AccumTrainer)."""
    objective: str = "sft"
    """A name from the recipe's objective table: sft (the answers' tokens) | dpo (preference pairs; the ``dpo``
    section) | grpo (rewards of generated completions; the ``grpo`` section)."""
    global_batch_size: int | None = None
    """Sequences per optimizer update over all processes; derives gradient_accumulation_steps."""
    overwrite_output_dir: bool = False
    """Allow writing into an output dir that holds a *different* run."""
    model: ModelSection = _section(ModelSection)
    data: DataSection = _section(DataSection)
    accumulation: AccumulationSection = _section(AccumulationSection)
    dpo: DPOSection = _section(DPOSection)
    grpo: GRPOSection = _section(GRPOSection)
    lora: dict[str, Any] | None = _section("peft:LoraConfig", {}, nullable=True, fixed={"task_type": "CAUSAL_LM"})
    """peft.LoraConfig fields; null = full fine-tuning."""
    quantization: dict[str, Any] | None = _section("transformers:BitsAndBytesConfig", nullable=True)
    """transformers.BitsAndBytesConfig fields; null = unquantized."""
    training: TrainingSection = _section(
        "transformers:TrainingArguments", TrainingSection(), container=TrainingSection,
        # resume: true (the latest complete checkpoint in output_dir, Trainer's convention) or a path; fsdp: true.
        type_overrides={"resume_from_checkpoint": bool | str | None, "fsdp": bool | str | list[str] | None},
    )
    """transformers.TrainingArguments fields."""
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False, metadata={"derived": True})
    """Which layer set each dotted key (for messages); not part of the saved config."""
    notes: list[str] = field(default_factory=list, repr=False, compare=False, metadata={"derived": True})
    """Decisions taken while merging and resolving (printed by the recipe); not part of the saved config."""

    def lora_config(self) -> Any:
        return SECTIONS["lora"].build("lora", self.lora)

    def bnb_config(self) -> Any:
        return SECTIONS["quantization"].build("quantization", self.quantization)

    def training_arguments(self, **changes: Any) -> Any:
        return SECTIONS["training"].build("training", self.training, **changes)

    def source(self, dotted: str) -> str:
        """The layer that set ``dotted`` (e.g. ``training.learning_rate``)."""
        return self.sources.get(dotted, BUILTIN)

    def layer_rank(self, dotted: str) -> int:
        """0: built in; 1: the YAML (a file or the embedded default); 2: the command line."""
        return {BUILTIN: 0, COMMAND_LINE: 2}.get(self.source(dotted), 1)

    def to_dict(self) -> dict[str, Any]:
        return {name: _saved(getattr(self, name)) for name in TOP_LEVEL}

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"training.learning_rate": 2e-4, ...}`` with scalar values (what trackers store as hyperparameters)."""
        flat = _flat(self.to_dict())
        return {key: v if isinstance(v, (int, float, str, bool)) else str(v) for key, v in flat.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)


def _saved(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return copy.deepcopy(dict(value) if isinstance(value, dict) else value)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty mapping is a value."""
    if not isinstance(tree, dict) or not tree:
        return {prefix[:-1]: tree}
    return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting that differs between two saved configs (a different run). A key the
    saved config lacks (a run saved before the key existed) counts as its built-in default: that run trained
    with it, so a run resumed with the default is the same run."""
    old, new = _flat(saved), _flat(current)
    defaults = _flat(build_config({}).to_dict())
    old.update({key: defaults[key] for key in new.keys() - old.keys() if key in defaults})
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key) and not key.startswith(NOT_PART_OF_THE_RUN)]


# The section registry: every RecipeConfig field that carries a Section; the top-level keys.
SECTIONS: dict[str, Section] = {
    f.name: f.metadata["section"] for f in dataclasses.fields(RecipeConfig) if "section" in f.metadata
}
TOP_LEVEL = [f.name for f in dataclasses.fields(RecipeConfig) if not f.metadata.get("derived")]


def build_config(tree: dict[str, Any], sources: dict[str, str] | None = None,
                 notes: Sequence[str] = ()) -> RecipeConfig:
    """Check keys and types of a raw mapping and return the typed config (no cross-field checks)."""
    return RecipeConfig(**checked("", tree, _top_level_types()), sources=dict(sources or {}), notes=list(notes))


@functools.cache
def _top_level_types() -> dict[str, Any]:
    """The top-level keys' types; a section's "type" is its :class:`Section`."""
    hints = typing.get_type_hints(RecipeConfig)
    return {name: SECTIONS.get(name, hints[name]) for name in TOP_LEVEL}


# An unknown name's message lists every valid name only when there are few (sections, engines); a section of
# many keys (training: ~120 TrainingArguments fields, ~1,900 characters) names its closest keys and how to list all.
LIST_ALL_UP_TO = 12


def unknown_key(where: str, key: str, valid: Sequence[str], what: str = "key") -> ConfigError:
    """The one unknown-name message: the closest matches (difflib, at most 3), and every valid name when they
    are few, else how many there are and the command that lists them."""
    close = difflib.get_close_matches(key, list(valid), n=3)
    hint = f" Did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
    if len(valid) <= LIST_ALL_UP_TO:
        return ConfigError(f"unknown {what} '{where}{key}'.{hint} Valid {what}s: {', '.join(sorted(valid))}")
    section = where.rstrip(".")
    return ConfigError(f"unknown {what} '{where}{key}'.{hint} ({len(valid)} valid {what}s; list them: "
                       f"python recipes/finetune_llama.py --keys {section})")


def valid_keys(section: str | None = None) -> list[str]:
    """The keys a config may set: the top-level keys and sections (``section`` None), or one section's keys."""
    if not section:
        return sorted(TOP_LEVEL)
    if section not in SECTIONS:
        raise unknown_key("", section, list(SECTIONS), what="section")
    return sorted(SECTIONS[section].types())


def checked(prefix: str, raw: dict[str, Any], types: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with every key known and every value coerced to its type; ConfigError naming ``prefix + key``."""
    for key in raw:
        if key not in types and prefix and key in TOP_LEVEL:  # e.g. training.overwrite_output_dir (a 4.x field)
            raise ConfigError(f"unknown key '{prefix}{key}': {key} is a top-level key, not part of {prefix[:-1]}: "
                              f"write {key}=... on the command line, or {key}: at the top of the YAML")
        if key not in types:
            raise unknown_key(prefix, key, list(types))
    return {key: coerce(value, types[key], prefix + key) for key, value in raw.items()}


def field_types(cls: type) -> dict[str, Any]:
    """``{name: annotation}`` of the keys ``cls(**kwargs)`` accepts: the ``__init__`` parameters (BitsAndBytesConfig's
    hand-written ``__init__`` differs from its dataclass fields), typed by the class annotations, else by the
    default's type (``Any`` when it is None or the annotations cannot be resolved)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: check keys, not types
        hints = {}
    params = inspect.signature(cls).parameters.values()
    return {p.name: hints.get(p.name, type(p.default) if isinstance(p.default, (bool, int, float, str)) else Any)
            for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """``value`` checked against ``annotation`` (pydantic strict), a string converted (lax); the result as YAML saves
    it (pydantic's JSON mode: enum members as values, tuples as lists). A :class:`Section` checks its mapping."""
    if isinstance(annotation, Section):
        return annotation.check(key, value)
    adapter, errors = _adapter(annotation), []
    # YAML 1.1 reads an unquoted no (save_strategy: no) as false; a string may need lax conversion.
    tries = [(value, True)] + [("no", True)] * (value is False) + [(value, False)] * isinstance(value, str)
    for candidate, strict in tries:
        try:
            return adapter.dump_python(adapter.validate_python(candidate, strict=strict), mode="json")
        except ValidationError as exc:
            errors.append(exc)
    name = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
    why = "; ".join(dict.fromkeys(e["msg"] for e in errors[-1 if isinstance(value, str) else 0].errors()))
    raise ConfigError(f"{key}: expected {name}, got {value!r} ({type(value).__name__}): {why}")


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    try:
        return TypeAdapter(annotation)
    except PydanticSchemaGenerationError:  # a type pydantic cannot describe: the HF constructor checks the value
        return TypeAdapter(Any)
