"""The typed recipe config: schema (sections, one registry), layers (built-in defaults < YAML < command
line), coercion to the classes' own types, validation (with hooks the data and model modules own),
and the saved copy.

This package owns the *shape* of a recipe run and every check that can be made before a model is
loaded:

* :mod:`~hf_accum.recipe.config.schema` -- :class:`RecipeConfig` and its sections (``model``, ``data``,
  ``lora``, ``quantization``, ``training``), the saved copy and how two saved copies differ;
* :mod:`~hf_accum.recipe.config.coercion` -- keys and types read from the classes, values coerced;
* :mod:`~hf_accum.recipe.config.layers` -- merging the layers, each key's source remembered;
* :mod:`~hf_accum.recipe.config.validation` -- :func:`resolve` and :func:`load_recipe_config`.
"""

from hf_accum.recipe.config.coercion import field_types
from hf_accum.recipe.config.layers import (
    build_config,
    load_config,
    load_yaml,
    merge_layers,
    overrides_tree,
    parse_overrides,
)
from hf_accum.recipe.config.schema import (
    BUILTIN,
    BUILTIN_DEFAULTS,
    COMMAND_LINE,
    EMBEDDED_SOURCE,
    NOT_PART_OF_THE_RUN,
    RESOLVED_CONFIG_NAME,
    SECTION_IDENTITY,
    SECTIONS,
    TOP_LEVEL,
    ConfigError,
    DataSection,
    DPOSection,
    ModelSection,
    RecipeConfig,
    Section,
    coerce,
    differences,
    section_types,
)
from hf_accum.recipe.config.validation import bf16_supported, load_recipe_config, resolve, world_size_from_env

__all__ = [
    "BUILTIN", "BUILTIN_DEFAULTS", "COMMAND_LINE", "EMBEDDED_SOURCE", "NOT_PART_OF_THE_RUN", "RESOLVED_CONFIG_NAME",
    "SECTIONS", "SECTION_IDENTITY", "TOP_LEVEL", "ConfigError", "DPOSection", "DataSection", "ModelSection",
    "RecipeConfig",
    "Section", "bf16_supported", "build_config", "coerce", "differences", "field_types", "load_config",
    "load_recipe_config", "load_yaml", "merge_layers", "overrides_tree", "parse_overrides", "resolve",
    "section_types", "world_size_from_env",
]
