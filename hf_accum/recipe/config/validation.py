"""What a config's names must be before anything else is checked (:func:`prepared`): ``engine`` and ``objective``
are names from the recipe's own tables, passed in (its ``ENGINES`` and ``OBJECTIVES``: this kit knows no engine
and no objective), and the derived defaults (``training.output_dir``) filled in.

What the values *mean* (the batch arithmetic, each section's check, the run's objects built on toy inputs) is checked
by the modules that own those meanings, all in one pass by :func:`hf_accum.recipe.checks.resolve`: they import this
kit, never the reverse.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Collection

from hf_accum.recipe.config.schema import ConfigError, RecipeConfig, unknown_key
from hf_accum.recipe.config.sections import TrainingSection
from hf_accum.recipe.embedded import default_config_path


def prepared(config: RecipeConfig, engines: Collection[str], objectives: Collection[str],
             default_output_dir: str = "outputs/run") -> RecipeConfig:
    """A copy of ``config`` (training and notes copied too) with ``training.output_dir`` filled, its engine and
    objective checked against the recipe's tables; ConfigError naming the key and the allowed names."""
    config = dataclasses.replace(config, training=TrainingSection(config.training), notes=list(config.notes))
    config.training.setdefault("output_dir", default_output_dir)
    if config.engine not in engines:
        raise unknown_key("engine=", config.engine, list(engines), what="value")
    if config.objective not in objectives:
        raise ConfigError(f"objective={config.objective!r}; allowed: {', '.join(objectives)}")
    return config


def output_dir_of(path: str | None, objective: str) -> str:
    """``outputs/<config file name>``; without a file, the name of the objective's embedded default."""
    yaml_path = path or default_config_path(objective)
    return os.path.join("outputs", os.path.splitext(os.path.basename(yaml_path))[0])
