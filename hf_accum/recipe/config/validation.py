"""Validating a config before anything loads, in ONE pass (:func:`resolve`): derived values, cross-field rules,
each section's own check, then the run's objects built on toy inputs (:mod:`hf_accum.recipe.preflight`).

Every refusal is one line naming the key and the layer it came from. The batch arithmetic: ``global_batch_size``
derives ``training.gradient_accumulation_steps`` (the higher layer wins when both are set, logged; in one layer
they must agree). The ``accumulation`` section: ``rampup_batch_size`` / ``tokens_per_update`` (loop engine only)
change the window per update; with a token budget a ``global_batch_size`` or accumulation of a lower layer yields
(a note says so, K becomes 1), one of the same layer or above is a conflict. ``noise_scale`` is refused under
DeepSpeed (its engine keeps the micro-batch gradients); ``normalization``: token | sequence.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from hf_accum.errors import InputError
from hf_accum.loop.windows import refuse_planned_windows
from hf_accum.rampup import RampUp
from hf_accum.recipe.config.layers import load_config, parse_overrides
from hf_accum.recipe.config.schema import BUILTIN, COMMAND_LINE, SECTIONS, ConfigError, RecipeConfig, unknown_key
from hf_accum.recipe.config.sections import TrainingSection
from hf_accum.recipe.preflight import build_run_objects
from hf_accum.sequence_norm import NORMALIZATIONS


def world_size_from_env() -> int:
    """Processes of this launch, as torchrun / accelerate launch announce them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve(
    config: RecipeConfig, engines: Sequence[str], world_size: int | None = None, default_output_dir: str = "outputs/run"
) -> RecipeConfig:
    """Fill derived values (accumulation steps from the global batch, output_dir) and validate everything that
    does not need the model. ``engines``: the names of the recipe's engine table. Returns a new config."""
    config = dataclasses.replace(config, training=TrainingSection(config.training), notes=list(config.notes))
    world_size = world_size or world_size_from_env()
    config.training.setdefault("output_dir", default_output_dir)
    if config.engine not in engines:
        raise unknown_key("engine=", config.engine, list(engines), what="value")
    _resolve_batch(config, world_size)
    _check_duration(config)
    _check_precision(config)
    if config.quantization is not None and config.lora is None:
        raise ConfigError("quantization needs lora (QLoRA): quantized base weights cannot be fine-tuned directly")
    _check_sections(config)
    _check_accumulation(config, world_size)
    _check_step_intervals(config)
    build_run_objects(config)
    return config


def load_recipe_config(argv: Sequence[str], engines: Sequence[str]) -> RecipeConfig:
    """The recipe's config from its command line: layers merged, typed and validated (nothing loaded, nothing
    written). The default output dir is ``outputs/<config file name>``."""
    path, overrides = parse_overrides(argv)
    name = os.path.splitext(os.path.basename(path))[0] if path else "cpu_default"
    return resolve(load_config(path, overrides), engines, default_output_dir=os.path.join("outputs", name))


def _check_sections(config: RecipeConfig) -> None:
    """Each section's own check, by the module that owns its meaning; its InputError becomes a ConfigError."""
    for name, section in SECTIONS.items():
        try:
            if section.validator is not None:
                section.validator(getattr(config, name), config)
        except ConfigError:
            raise
        except InputError as exc:
            raise ConfigError(str(exc)) from exc


def _layer_rank(source: str) -> int:
    return {BUILTIN: 0, COMMAND_LINE: 2}.get(source, 1)  # the YAML (a file or the embedded default) between


def _resolve_batch(config: RecipeConfig, world_size: int) -> None:
    """``training.gradient_accumulation_steps`` from ``global_batch_size``; errors name each value's layer."""
    from hf_accum.schedule import plan_global_batch

    t = config.training
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(t, key) < 1:
            raise ConfigError(f"training.{key}={getattr(t, key)} ({config.source('training.' + key)}) must be >= 1")
    if config.global_batch_size is None:
        return
    given = t.get("gradient_accumulation_steps")
    batch_source = config.source("global_batch_size")
    steps_source = config.source("training.gradient_accumulation_steps")
    if given is not None and _layer_rank(steps_source) > _layer_rank(batch_source):
        config.notes.append(
            f"training.gradient_accumulation_steps={given} ({steps_source}) replaces global_batch_size="
            f"{config.global_batch_size} ({batch_source}): effective batch "
            f"{t.per_device_train_batch_size * given * world_size}"
        )
        config.global_batch_size = None
        return
    try:
        plan = plan_global_batch(config.global_batch_size, t.per_device_train_batch_size, world_size)
    except ValueError as exc:
        raise ConfigError(f"{exc} [global_batch_size from {batch_source}]") from exc
    if given is not None and given != plan.accumulation_steps:
        if _layer_rank(steps_source) == _layer_rank(batch_source):
            raise ConfigError(
                f"global_batch_size={config.global_batch_size} with {t.per_device_train_batch_size} per device x "
                f"{world_size} processes needs gradient_accumulation_steps={plan.accumulation_steps}, but "
                f"training.gradient_accumulation_steps={given}; both set in {batch_source}: set only one of them"
            )
        config.notes.append(
            f"global_batch_size={config.global_batch_size} ({batch_source}) replaces training.gradient_accumulation_"
            f"steps={given} ({steps_source}): {plan.accumulation_steps} accumulation steps"
        )
    t["gradient_accumulation_steps"] = plan.accumulation_steps


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
    return torch.cuda.is_bf16_supported()


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


# How often each periodic action runs: (strategy key, interval key).
STEP_INTERVALS = (("save_strategy", "save_steps"), ("eval_strategy", "eval_steps"),
                  ("logging_strategy", "logging_steps"))


def _check_step_intervals(config: RecipeConfig) -> None:
    """``save_steps`` / ``eval_steps`` / ``logging_steps`` must be a positive number of updates (or a fraction of
    them, below 1) where their strategy is ``steps``: 0 would divide by zero in the loop and be ignored silently by
    Trainer, in either engine."""
    t = config.training
    for strategy_key, steps_key in STEP_INTERVALS:
        strategy, steps = str(getattr(t, strategy_key)), getattr(t, steps_key)
        if strategy.rsplit(".", 1)[-1].lower() != "steps" or steps is None or steps > 0:
            continue
        raise ConfigError(
            f"training.{steps_key}={steps:g} ({config.source('training.' + steps_key)}) with training.{strategy_key}="
            f"steps: use a number of updates >= 1 (or a fraction of the planned updates, between 0 and 1), or set "
            f"training.{strategy_key}=no"
        )


_BUDGET = "accumulation.tokens_per_update"


def _check_accumulation(config: RecipeConfig, world_size: int) -> None:
    """The ``accumulation`` section against the engine and the resolved batch arithmetic."""
    section, t = config.accumulation, config.training
    if section.normalization not in NORMALIZATIONS:
        raise ConfigError(f"accumulation.normalization={section.normalization!r}; allowed: {', '.join(NORMALIZATIONS)}")
    if section.noise_scale and t.get("deepspeed"):
        raise ConfigError("accumulation.noise_scale=true is not available with training.deepspeed (the engine "
                          "keeps the micro-batch gradients); allowed: false, or drop training.deepspeed")
    if section.noise_scale and t.gradient_accumulation_steps == 1:
        config.notes.append("accumulation.noise_scale=true with one micro-batch per update and process: only "
                            "updates spanning several micro-batches are measured")
    if config.engine != "loop":
        refuse_planned_windows("accumulation.", section.rampup_batch_size, section.tokens_per_update)
    if section.rampup_batch_size is not None:  # the nearest valid values when it does not fit the batch
        micro = t.per_device_train_batch_size
        RampUp.from_list(list(section.rampup_batch_size), micro * t.gradient_accumulation_steps * world_size, micro,
                         world_size, key="accumulation.rampup_batch_size")
    if section.tokens_per_update is not None:
        _yield_batch_keys(config)


def _yield_batch_keys(config: RecipeConfig) -> None:
    """A token budget sizes the update: a batch key of a lower layer yields (noted), one of its layer or above
    conflicts."""
    budget, budget_rank = config.accumulation.tokens_per_update, _layer_rank(config.source(_BUDGET))
    for key, value in (("global_batch_size", config.global_batch_size),
                       ("training.gradient_accumulation_steps", config.training.get("gradient_accumulation_steps"))):
        source = config.source(key)
        if value is not None and source != BUILTIN and _layer_rank(source) >= budget_rank:  # BUILTIN: derived
            raise ConfigError(f"{_BUDGET}={budget} ({config.source(_BUDGET)}) and {key}={value} ({source}) both "
                              "size the update; set only one of them")
    if config.global_batch_size is not None or config.training.gradient_accumulation_steps != 1:
        config.notes.append(f"{_BUDGET}={budget} replaces global_batch_size / gradient_accumulation_steps of a "
                            "lower layer: each update holds that many targets")
    config.global_batch_size = None
    config.training["gradient_accumulation_steps"] = 1
