"""Validating a config before anything loads, in ONE pass (:func:`resolve`): derived values, cross-field rules,
each section's own check (``Section.validator``), then the run's objects built on toy inputs
(:mod:`hf_accum.recipe.preflight`). Every refusal is one line naming the key and the layer it came from.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from hf_accum.errors import InputError
from hf_accum.recipe.config.layers import load_config, parse_overrides
from hf_accum.recipe.config.schema import SECTIONS, ConfigError, RecipeConfig, unknown_key
from hf_accum.recipe.config.sections import TrainingSection
from hf_accum.recipe.embedded import default_config_path
from hf_accum.recipe.preflight import build_run_objects
from hf_accum.schedule import plan_global_batch


def resolve(config: RecipeConfig, engines: Sequence[str], world_size: int | None = None,
            default_output_dir: str = "outputs/run") -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate everything that
    does not need the model. ``engines``: the names of the recipe's engine table. Returns a new config."""
    config = dataclasses.replace(config, training=TrainingSection(config.training), notes=list(config.notes))
    config.training.setdefault("output_dir", default_output_dir)
    if config.engine not in engines:
        raise unknown_key("engine=", config.engine, list(engines), what="value")
    _resolve_batch(config, world_size or int(os.environ.get("WORLD_SIZE", "1")))
    _check_duration(config)
    _check_precision(config)
    if config.quantization is not None and config.lora is None:
        raise ConfigError("quantization needs lora (QLoRA): quantized base weights cannot be fine-tuned directly")
    try:  # each section's meaning, checked by the module that owns it; then the run's objects, built
        for name, section in SECTIONS.items():
            if section.validator is not None:
                section.validator(getattr(config, name), config)
        _check_step_intervals(config)
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


def _resolve_batch(config: RecipeConfig, world_size: int) -> None:
    """``training.gradient_accumulation_steps`` from ``global_batch_size``: the higher layer wins when both are set
    (noted); set in one layer they must agree. Errors name each value's layer."""
    t, steps_key = config.training, "training.gradient_accumulation_steps"
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(t, key) < 1:
            raise ConfigError(f"training.{key}={getattr(t, key)} ({config.source('training.' + key)}) must be >= 1")
    if config.global_batch_size is None:
        return
    given, micro, batch = t.get("gradient_accumulation_steps"), t.per_device_train_batch_size, config.global_batch_size
    batch_source, steps_source = config.source("global_batch_size"), config.source(steps_key)
    if given is not None and config.layer_rank(steps_key) > config.layer_rank("global_batch_size"):
        config.notes.append(f"{steps_key}={given} ({steps_source}) replaces global_batch_size={batch} "
                            f"({batch_source}): effective batch {micro * given * world_size}")
        config.global_batch_size = None
        return
    try:
        steps = plan_global_batch(batch, micro, world_size).accumulation_steps
    except ValueError as exc:
        raise ConfigError(f"{exc} [global_batch_size from {batch_source}]") from exc
    if given is not None and given != steps:
        if config.layer_rank(steps_key) == config.layer_rank("global_batch_size"):
            raise ConfigError(f"global_batch_size={batch} with {micro} per device x {world_size} processes needs "
                              f"gradient_accumulation_steps={steps}, but {steps_key}={given}; both set in "
                              f"{batch_source}: set only one of them")
        config.notes.append(f"global_batch_size={batch} ({batch_source}) replaces {steps_key}={given} "
                            f"({steps_source}): {steps} accumulation steps")
    t["gradient_accumulation_steps"] = steps


def _check_duration(config: RecipeConfig) -> None:
    """A run must have a length: max_steps >= 1, or num_train_epochs > 0; a negative epoch count means nothing
    even where max_steps sets the length (an untrained model saved as a finished run is worse than an error)."""
    t = config.training
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError(f"training.max_steps={t.max_steps} ({config.source('training.max_steps')}): use a number "
                          "of updates >= 1, or -1 to train for training.num_train_epochs")
    if t.num_train_epochs < 0 or (t.max_steps == -1 and not t.num_train_epochs > 0):
        allowed = "> 0 (or set training.max_steps >= 1)" if t.max_steps == -1 else \
            f">= 0 (training.max_steps={t.max_steps} sets the length)"
        raise ConfigError(f"training.num_train_epochs={float(t.num_train_epochs)} "
                          f"({config.source('training.num_train_epochs')}) must be {allowed}")


def bf16_supported(use_cpu: bool) -> bool:
    import torch

    if use_cpu or not torch.cuda.is_available():
        return use_cpu  # CPU autocast runs bf16, but TrainingArguments only allows it when use_cpu is explicit
    return bool(torch.cuda.is_bf16_supported())


def _check_precision(config: RecipeConfig) -> None:
    t = config.training
    if (t.bf16 or config.model.dtype == "bfloat16") and not bf16_supported(bool(t.use_cpu)):
        raise ConfigError(
            "bf16 requested (training.bf16 / model.dtype: bfloat16) but this machine has no bf16-capable GPU. "
            "Set training.bf16: false and model.dtype: float32, or training.use_cpu: true for CPU bf16 autocast."
        )
    if t.bf16 and t.fp16:
        raise ConfigError("training.bf16 and training.fp16 are both true; pick one")
    if config.model.dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ConfigError(f"model.dtype={config.model.dtype!r}; allowed: float32, bfloat16, float16, auto")


def _check_step_intervals(config: RecipeConfig) -> None:
    """``save_steps`` / ``eval_steps`` / ``logging_steps`` must be a positive number of updates (or a fraction of
    them, below 1) where their strategy is ``steps``: 0 would divide by zero in the loop and be ignored silently by
    Trainer, in either engine."""
    for action in ("save", "eval", "logging"):
        strategy = str(getattr(config.training, f"{action}_strategy"))
        steps = getattr(config.training, f"{action}_steps")
        if strategy.rsplit(".", 1)[-1].lower() != "steps" or steps is None or steps > 0:
            continue
        raise ConfigError(
            f"training.{action}_steps={steps:g} ({config.source(f'training.{action}_steps')}) with training."
            f"{action}_strategy=steps: use a number of updates >= 1 (or a fraction of the planned updates, between 0 "
            f"and 1), or set training.{action}_strategy=no"
        )
