"""Building a config from its layers: built-in defaults < YAML < command line, each key's source kept.

Layers, lowest first, each remembered as the *source* of the keys it sets (errors name it):

1. built-in defaults: the dataclass defaults and :data:`BUILTIN_DEFAULTS` (sensible for a real
   fine-tune: LoRA on every linear layer, bf16 off, TrainingArguments' own defaults otherwise);
2. the YAML: ``--config FILE``, or ``recipes/configs/cpu_default.yaml`` (shipped in the package,
   :func:`hf_accum.recipe.embedded.default_config_path`) when no ``--config`` is given -- the tiny CPU job;
3. the command line: dotted keys, in either form::

       --training.learning_rate 1e-4     --lora.r=16     training.max_steps=5     --lora null

   values are parsed as YAML (``[q_proj, v_proj]``, ``null``, ``true``), then coerced to the
   field's type (so ``1e-4`` is a float even though YAML 1.1 reads it as a string).

Two rules keep the layers from mixing what belongs together:

* a layer that sets ``data.dataset`` (or ``model.name_or_path``) to something new starts that
  section afresh: the lower layer's data settings (splits, columns, sizes) described *its*
  dataset, not this one;
* ``training.gradient_accumulation_steps`` and ``global_batch_size`` both fix the accumulation:
  the higher layer wins (logged, :mod:`~hf_accum.recipe.config.validation`); set in the same
  layer, they must agree.
"""

from __future__ import annotations

import copy
import os
import typing
from typing import Any, Sequence

import yaml

from hf_accum.recipe.config.schema import (
    BUILTIN,
    BUILTIN_DEFAULTS,
    COMMAND_LINE,
    EMBEDDED_SOURCE,
    SECTION_IDENTITY,
    SECTIONS,
    TOP_LEVEL,
    ConfigError,
    RecipeConfig,
    coerce,
    section_types,
    unknown_key,
)
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
                raise unknown_key("", key, TOP_LEVEL)
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
            raise unknown_key("", key, TOP_LEVEL)
        values[key] = SECTIONS[key].check(key, raw) if key in SECTIONS else coerce(raw, hints[key], key)
    return RecipeConfig(**values, sources=dict(sources or {}))


def load_config(path: str | None, overrides: dict[str, Any] | None = None) -> RecipeConfig:
    """Built-in defaults < the YAML at ``path`` (the embedded default when None) < ``overrides``;
    typed, not yet validated."""
    # With no --config, the embedded default of the objective asked for on the command line (objective=dpo).
    objective = str((overrides or {}).get("objective", "sft"))
    yaml_layer = (path, load_yaml(path)) if path else (EMBEDDED_SOURCE, load_yaml(default_config_path(objective)))
    layers = [(BUILTIN, BUILTIN_DEFAULTS), yaml_layer, (COMMAND_LINE, overrides_tree(overrides or {}))]
    tree, sources = merge_layers(layers)
    return build_config(tree, sources)

