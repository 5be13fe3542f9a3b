"""Validating a recipe config before anything loads, in ONE pass (:func:`resolve`): the names (the engine and the
objective, from the recipe's tables: :func:`hf_accum.recipe.config.prepared`), the batch arithmetic
(:func:`~hf_accum.recipe.accumulation_section.resolve_batch`), each section's own check, then the run's objects
built on toy inputs, with the values they accept but would train wrongly with (:mod:`hf_accum.recipe.preflight`).
Every refusal is one line naming the key and its layer.

Each check belongs to the module that owns what the values mean (the model's: :mod:`hf_accum.recipe.modeling`; the
data's: :mod:`hf_accum.recipe.data`; ...). Those modules import the config kit; the kit imports none of them. This
module sits above both and is the one place that runs them (a new section's check is one line in
:func:`check_sections`).
"""

from __future__ import annotations

import os
from typing import Collection, Sequence

from hf_accum.errors import InputError
from hf_accum.recipe.accumulation_section import check_accumulation_section, resolve_batch
from hf_accum.recipe.command_line import parse_overrides
from hf_accum.recipe.config import ConfigError, RecipeConfig, load_config, output_dir_of, prepared
from hf_accum.recipe.data import check_data_section
from hf_accum.recipe.grpo_section import check_grpo_section
from hf_accum.recipe.modeling import check_model_section, check_quantization_section
from hf_accum.recipe.preference_section import check_dpo_section
from hf_accum.recipe.preflight import build_run_objects


def resolve(config: RecipeConfig, engines: Collection[str], objectives: Collection[str],
            world_size: int | None = None, default_output_dir: str = "outputs/run") -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate everything that
    does not need the model. ``engines`` / ``objectives``: the names of the recipe's engine and objective tables.
    Returns a new config."""
    config = prepared(config, engines, objectives, default_output_dir)
    try:
        resolve_batch(config, world_size or int(os.environ.get("WORLD_SIZE", "1")))
        if config.quantization is not None and config.lora is None:
            raise ConfigError("quantization needs lora (QLoRA): quantized base weights cannot be fine-tuned directly")
        check_sections(config)
        build_run_objects(config)
    except ConfigError:
        raise
    except InputError as exc:
        raise ConfigError(str(exc)) from exc
    return config


def check_sections(config: RecipeConfig) -> None:
    """Each section's own check, by the module that owns its meaning, in the order of the sections."""
    check_model_section(config.model, config)
    check_data_section(config.data, config)
    check_accumulation_section(config.accumulation, config)
    check_dpo_section(config.dpo, config)
    check_grpo_section(config.grpo, config)
    check_quantization_section(config.quantization, config)


def load_recipe_config(argv: Sequence[str], engines: Collection[str], objectives: Collection[str]) -> RecipeConfig:
    """The recipe's config from its command line: layers merged, typed and validated (nothing loaded, nothing
    written). The default output dir is ``outputs/<config file name>`` (the embedded default's, without one)."""
    path, overrides = parse_overrides(argv)
    output_dir = output_dir_of(path, str(overrides.get("objective", "sft")))
    return resolve(load_config(path, overrides), engines, objectives, default_output_dir=output_dir)
