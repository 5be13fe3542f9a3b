"""Building a config from its layers: built-in defaults < YAML (``--config FILE``, else the objective's embedded
default, ``cpu_default.yaml`` / ``cpu_dpo.yaml``) < command line (``--training.learning_rate 1e-4``, ``--lora.r=16``,
``training.max_steps=5``, ``--lora null``; values parsed as YAML), each key's source kept for messages.

An override changes only its key. One exception, always announced: a new ``model.name_or_path`` /
``data.dataset`` (the section's ``IDENTITY``) drops the lower layers' keys that described the previous model /
dataset (its ``TIED`` keys), and a note names each one dropped.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Sequence

import yaml

from hf_accum.recipe.config.schema import (
    BUILTIN,
    COMMAND_LINE,
    SECTIONS,
    ConfigError,
    RecipeConfig,
    build_config,
    unknown_key,
)
from hf_accum.recipe.embedded import default_config_path

# The built-in layer: recipe-level defaults that differ from the HF classes' own defaults.
BUILTIN_DEFAULTS: dict[str, Any] = {
    "engine": "loop",
    "lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"},
    "training": {"report_to": "none", "logging_steps": 10},
}


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
            raise unknown_key("", head, list(SECTIONS), what="section")
        if tree.get(head) is None:
            tree[head] = {}
        if not isinstance(tree[head], dict):
            raise ConfigError(f"{head} must be a mapping to override {dotted}")
        sub, _, leaf = rest.partition(".")
        if leaf and sub in SECTIONS[head].types():  # a dict-valued field: training.gradient_checkpointing_kwargs.x
            tree[head].setdefault(sub, {})[leaf] = value
        else:
            tree[head][rest] = value
    return tree


def merge_layers(layers: Sequence[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Merge ``(source, tree)`` layers, lowest first: ``(tree, {dotted key: source}, notes)``. Sections merge key
    by key; ``null`` switches a nullable section off; the notes name every key a new identity dropped."""
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    for source, layer in layers:
        for key, value in layer.items():
            section = key in SECTIONS and isinstance(value, dict)
            if section and isinstance(tree.get(key), dict):
                notes += _drop_tied(key, tree[key], value, sources, source)
            else:  # a value, or a section replacing null: what the lower layers set under this key goes
                for known in [k for k in sources if k == key or k.startswith(f"{key}.")]:
                    del sources[known]
                tree[key] = {} if section else copy.deepcopy(value)
                sources.update({} if section else {key: source})
            if section:
                tree[key].update(copy.deepcopy(value))
                sources.update({f"{key}.{name}": source for name in value})
    return tree, sources, notes


def _drop_tied(name: str, section: dict[str, Any], values: dict[str, Any], sources: dict[str, str],
               source: str) -> list[str]:
    """A new model / dataset: the lower layers' keys that described the previous one go, each named in a note."""
    cls = SECTIONS[name].cls()
    identity = getattr(cls, "IDENTITY", None)
    if identity is None or identity not in values:
        return []
    previous = section.get(identity, getattr(cls, identity))  # the section's own, else the class default
    dropped = [key for key in getattr(cls, "TIED", ()) if key in section and key not in values]
    if values[identity] == previous or not dropped:
        return []
    named = ", ".join(f"{name}.{key}={section.pop(key)!r}" for key in dropped)
    for key in dropped:
        sources.pop(f"{name}.{key}", None)
    return [f"{name}.{identity}={values[identity]!r} ({source}) replaces {previous!r} ("
            f"{sources.get(f'{name}.{identity}', BUILTIN)}): dropped {named}, which described the previous one (set "
            f"again to keep); the other {name} keys are kept"]


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> RecipeConfig:
    """Built-in defaults < the YAML at ``path`` (None: the embedded default of the ``objective`` the overrides ask
    for) < ``overrides``; typed, not yet validated."""
    overrides = overrides or {}
    default = default_config_path(str(overrides.get("objective", "sft")))
    source = path or f"embedded default (recipes/configs/{os.path.basename(default)})"
    layers = [(BUILTIN, BUILTIN_DEFAULTS), (source, load_yaml(path or default))]
    return build_config(*merge_layers([*layers, (COMMAND_LINE, overrides_tree(overrides))]))
