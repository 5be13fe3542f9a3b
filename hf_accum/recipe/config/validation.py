"""Validating a config before anything loads, in ONE pass (:func:`resolve`): the batch arithmetic
(:func:`~hf_accum.recipe.accumulation_section.resolve_batch`), each section's own check (``Section.validator``;
the model's includes precision), then the run's objects built on toy inputs, with the values they accept but would
train wrongly with (:mod:`hf_accum.recipe.preflight`). Every refusal is one line naming the key and its layer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from hf_accum.errors import InputError
from hf_accum.recipe.accumulation_section import resolve_batch
from hf_accum.recipe.command_line import parse_overrides
from hf_accum.recipe.config.layers import load_config
from hf_accum.recipe.config.schema import SECTIONS, ConfigError, RecipeConfig, unknown_key
from hf_accum.recipe.config.sections import TrainingSection
from hf_accum.recipe.embedded import default_config_path
from hf_accum.recipe.preflight import build_run_objects


def resolve(config: RecipeConfig, engines: Sequence[str], world_size: int | None = None,
            default_output_dir: str = "outputs/run") -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate everything that
    does not need the model. ``engines``: the names of the recipe's engine table. Returns a new config."""
    config = dataclasses.replace(config, training=TrainingSection(config.training), notes=list(config.notes))
    config.training.setdefault("output_dir", default_output_dir)
    if config.engine not in engines:
        raise unknown_key("engine=", config.engine, list(engines), what="value")
    try:  # the batch arithmetic; each section's meaning, checked by the module that owns it; the objects
        resolve_batch(config, world_size or int(os.environ.get("WORLD_SIZE", "1")))
        if config.quantization is not None and config.lora is None:
            raise ConfigError("quantization needs lora (QLoRA): quantized base weights cannot be fine-tuned directly")
        for name, section in SECTIONS.items():
            if section.validator is not None:
                section.validator(getattr(config, name), config)
        build_run_objects(config)
    except ConfigError:
        raise
    except InputError as exc:
        raise ConfigError(str(exc)) from exc
    return config


def load_recipe_config(argv: Sequence[str], engines: Sequence[str]) -> RecipeConfig:
    """The recipe's config from its command line: layers merged, typed and validated (nothing loaded, nothing
    written). The default output dir is ``outputs/<config file name>`` (the embedded default's, without one)."""
    path, overrides = parse_overrides(argv)
    yaml_path = path or default_config_path(str(overrides.get("objective", "sft")))
    name = os.path.splitext(os.path.basename(yaml_path))[0]
    return resolve(load_config(path, overrides), engines, default_output_dir=os.path.join("outputs", name))
