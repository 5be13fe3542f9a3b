"""Building a config from its layers: built-in defaults < YAML (``--config FILE``, else the embedded
``cpu_default.yaml``) < command line (``--training.learning_rate 1e-4``, ``--lora.r=16``, ``training.max_steps=5``,
``--lora null``; values parsed as YAML), each key's source kept for messages.

An override changes only its key. One exception, always announced: a new ``model.name_or_path`` /
``data.dataset`` drops the lower layers' keys that described the previous model / dataset (``Section.tied``),
and a note names each one dropped.
"""

from __future__ import annotations

import copy
import functools
import os
import typing
from typing import Any, Sequence

import yaml

import hf_accum.recipe.config.schema as schema
from hf_accum.recipe.config.schema import BUILTIN, SECTIONS, TOP_LEVEL, ConfigError, RecipeConfig, unknown_key
from hf_accum.recipe.embedded import default_config_path


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
            raise unknown_key("", head, list(SECTIONS), what="section")
        if tree.get(head) is None:
            tree[head] = {}
        if not isinstance(tree[head], dict):
            raise ConfigError(f"{head} must be a mapping to override {dotted}")
        sub, _, leaf = rest.partition(".")
        if leaf and sub in SECTIONS[head].types():
            # e.g. training.gradient_checkpointing_kwargs.use_reentrant: a dict-valued field.
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
            if key not in TOP_LEVEL:
                raise unknown_key("", key, TOP_LEVEL)
            if key in SECTIONS and isinstance(value, dict):
                _merge_section(tree, sources, notes, key, value, source)
            else:
                tree[key] = copy.deepcopy(value)
                _forget(sources, key)
                sources[key] = source
    return tree, sources, notes


def _merge_section(tree, sources, notes: list[str], name: str, values: dict[str, Any], source: str) -> None:
    current = tree.get(name)
    if not isinstance(current, dict):
        tree[name] = {}
        _forget(sources, name)
    identity = SECTIONS[name].identity
    if isinstance(current, dict) and identity in values and values[identity] != _identity(name, current):
        _drop_tied(tree[name], sources, notes, name, values, source)
    for key, value in values.items():
        tree[name][key] = copy.deepcopy(value)
        sources[f"{name}.{key}"] = source


def _drop_tied(section: dict, sources, notes: list[str], name: str, values: dict[str, Any], source: str) -> None:
    """A new model / dataset: the lower layers' keys that described the previous one go, each named."""
    identity = SECTIONS[name].identity
    dropped = [key for key in SECTIONS[name].tied if key in section and key not in values]
    if not dropped:
        return
    previous = f"{_identity(name, section)!r} ({sources.get(f'{name}.{identity}', BUILTIN)})"
    named = ", ".join(f"{name}.{key}={section[key]!r}" for key in dropped)
    notes.append(f"{name}.{identity}={values[identity]!r} ({source}) replaces {previous}: dropped {named}, which "
                 f"described the previous one (set again to keep); the other {name} keys are kept")
    for key in dropped:
        del section[key]
        sources.pop(f"{name}.{key}", None)


def _identity(name: str, section: dict[str, Any]) -> Any:
    """The model / dataset a layer's section describes: its own, else the section's default."""
    identity = str(SECTIONS[name].identity)
    return section[identity] if identity in section else getattr(SECTIONS[name].cls()(), identity)


def _forget(sources: dict[str, str], prefix: str) -> None:
    for key in [k for k in sources if k == prefix or k.startswith(prefix + ".")]:
        del sources[key]


def build_config(tree: dict[str, Any], sources: dict[str, str] | None = None,
                 notes: Sequence[str] = ()) -> RecipeConfig:
    """Check keys and types of a raw mapping and return the typed config (no cross-field checks)."""
    values: dict[str, Any] = {}
    for key, raw in tree.items():
        if key not in TOP_LEVEL:
            raise unknown_key("", key, TOP_LEVEL)
        values[key] = SECTIONS[key].check(key, raw) if key in SECTIONS else \
            schema.coerce(raw, _top_level_types()[key], key)
    return RecipeConfig(**values, sources=dict(sources or {}), notes=list(notes))


@functools.cache
def _top_level_types() -> dict[str, Any]:
    return typing.get_type_hints(RecipeConfig)


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> RecipeConfig:
    """Built-in defaults < the YAML at ``path`` (the embedded default when None) < ``overrides``; typed, not yet
    validated."""
    # With no --config, the embedded default of the objective asked for on the command line (objective=dpo).
    objective = str((overrides or {}).get("objective", "sft"))
    default = default_config_path(objective)
    yaml_layer = (path, load_yaml(path)) if path else (schema.EMBEDDED_SOURCE, load_yaml(default))
    layers = [(BUILTIN, schema.BUILTIN_DEFAULTS), yaml_layer, (schema.COMMAND_LINE, overrides_tree(overrides or {}))]
    return build_config(*merge_layers(layers))
