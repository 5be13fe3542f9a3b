"""The typed recipe config: ``sections`` (the recipe's own sections), ``schema`` (:class:`RecipeConfig`, ONE
section registry, pydantic coercion, the saved copy), ``layers`` (defaults < YAML < command line, sources kept),
``validation`` (:func:`resolve`, one pass before anything loads)."""

from hf_accum.recipe.accumulation_section import AccumulationSection
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
from hf_accum.recipe.config.sections import DataSection, ModelSection, TrainingSection
from hf_accum.recipe.config.validation import load_recipe_config, resolve
from hf_accum.recipe.preference_section import DPOSection

__all__ = [
    "BUILTIN", "BUILTIN_DEFAULTS", "COMMAND_LINE", "RESOLVED_CONFIG_NAME", "SECTIONS", "AccumulationSection",
    "ConfigError", "DataSection", "DPOSection", "ModelSection", "RecipeConfig", "Section", "TrainingSection",
    "build_config", "differences", "load_config", "load_recipe_config", "load_yaml", "parse_overrides", "resolve",
    "valid_keys",
]
