"""The typed recipe config: what a run is, and every check that can be made before a model loads.

* :mod:`~hf_accum.recipe.config.sections` -- the sections the recipe declares (``model``, ``data``,
  ``accumulation``) and the typed ``training`` section;
* :mod:`~hf_accum.recipe.config.schema` -- :class:`RecipeConfig` (ONE section registry), keys and types read from
  the classes, values coerced by pydantic, the saved copy;
* :mod:`~hf_accum.recipe.config.layers` -- built-in defaults < YAML < command line, each key's source kept;
* :mod:`~hf_accum.recipe.config.validation` -- :func:`resolve` (one pass) and :func:`load_recipe_config`.
"""

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
    SECTIONS,
    TOP_LEVEL,
    ConfigError,
    RecipeConfig,
    Section,
    coerce,
    differences,
    field_types,
    section_types,
)
from hf_accum.recipe.config.sections import AccumulationSection, DataSection, ModelSection, TrainingSection
from hf_accum.recipe.config.validation import bf16_supported, load_recipe_config, resolve, world_size_from_env

__all__ = [
    "BUILTIN", "BUILTIN_DEFAULTS", "COMMAND_LINE", "EMBEDDED_SOURCE", "NOT_PART_OF_THE_RUN", "RESOLVED_CONFIG_NAME",
    "SECTIONS", "TOP_LEVEL", "AccumulationSection", "ConfigError", "DataSection", "ModelSection", "RecipeConfig",
    "Section", "TrainingSection", "bf16_supported", "build_config", "coerce", "differences", "field_types",
    "load_config", "load_recipe_config", "load_yaml", "merge_layers", "overrides_tree", "parse_overrides", "resolve",
    "section_types", "world_size_from_env",
]
