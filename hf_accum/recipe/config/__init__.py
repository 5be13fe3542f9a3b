"""The typed recipe config: ``sections`` (the recipe's sections: keys, types, docs), ``schema`` (:class:`RecipeConfig`,
ONE section registry, pydantic coercion, the saved copy), ``layers`` (defaults < YAML < command line, sources kept),
``validation`` (:func:`prepared`: the engine and objective named in the recipe's tables, passed in).

The kit points one way: it imports no component (data, modeling, preference, the engines) and no torch at import;
the components import it, and :mod:`hf_accum.recipe.checks` runs their checks of a config before anything loads
(:func:`hf_accum.recipe.checks.load_recipe_config`)."""

from hf_accum.recipe.command_line import parse_overrides
from hf_accum.recipe.config.layers import BUILTIN_DEFAULTS, load_config, load_yaml
from hf_accum.recipe.config.schema import (
    BUILTIN,
    COMMAND_LINE,
    RESOLVED_CONFIG_NAME,
    SECTIONS,
    ConfigError,
    RecipeConfig,
    Section,
    build_config,
    differences,
    valid_keys,
)
from hf_accum.recipe.config.sections import (
    AccumulationSection,
    DataSection,
    DPOSection,
    ModelSection,
    TrainingSection,
)
from hf_accum.recipe.config.validation import output_dir_of, prepared

__all__ = [
    "BUILTIN", "BUILTIN_DEFAULTS", "COMMAND_LINE", "RESOLVED_CONFIG_NAME", "SECTIONS", "AccumulationSection",
    "ConfigError", "DataSection", "DPOSection", "ModelSection", "RecipeConfig", "Section", "TrainingSection",
    "build_config", "differences", "load_config", "load_yaml", "output_dir_of", "parse_overrides", "prepared",
    "valid_keys",
]
