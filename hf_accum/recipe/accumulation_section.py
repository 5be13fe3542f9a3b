"""The size of the recipe's updates: the ``accumulation:`` section (its keys are the fields of
:class:`hf_accum.settings.AccumulationSettings`, each value checked when the section is built) and, before anything
loads, the batch keys resolved and what the section needs of the rest of the run checked
(:func:`check_accumulation_section`, run by :mod:`hf_accum.recipe.checks`).

* :func:`resolve_batch`: ``training.gradient_accumulation_steps`` from ``global_batch_size`` (the higher layer wins
  when both are set, said in a note; set in one layer they must agree).
* ``rampup_batch_size`` and ``tokens_per_update`` (loop engine only): the window changes from update to update
  (:mod:`hf_accum.loop.windows`). With a token budget the update's size is the budget: a ``global_batch_size`` or
  ``training.gradient_accumulation_steps`` from a lower layer yields to it (a note says so, and the Accelerator's K
  becomes 1); one given in the same layer or above is a conflict.
* ``noise_scale: true``: refused under DeepSpeed (its engine keeps the micro-batch gradients); one micro-batch per
  update measures nothing (said, not refused).
* ``loss_kind``: the recipe trains causal LMs (null or causal_lm).

Both engines take the section object itself: ``LoopConfig.from_training_arguments(args, accumulation=section)``
(built once, by :mod:`hf_accum.recipe.preflight`) and ``AccumTrainer(..., accumulation=section)``.
"""

from __future__ import annotations

import os

from hf_accum.errors import InputError
from hf_accum.planning.auto_ramp import AutoRampSettings, BatchController
from hf_accum.planning.planned_windows import refuse_planned_windows
from hf_accum.planning.rampup import RampUp
from hf_accum.planning.schedule import plan_global_batch
from hf_accum.recipe.config.schema import RecipeConfig
from hf_accum.settings import AccumulationSettings

_BUDGET = "accumulation.tokens_per_update"


class AccumulationError(InputError):
    """A value of the ``accumulation`` section the engines cannot honour."""


def resolve_batch(config: RecipeConfig, world_size: int) -> None:
    """``training.gradient_accumulation_steps`` from ``global_batch_size``; errors and notes name each value's layer."""
    t, steps_key = config.training, "training.gradient_accumulation_steps"
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if (value := getattr(t, key)) < 1:
            raise AccumulationError(f"training.{key}={value} ({config.source('training.' + key)}) must be >= 1")
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
        raise AccumulationError(f"{exc} [global_batch_size from {batch_source}]") from exc
    if given is not None and given != steps:
        if config.layer_rank(steps_key) == config.layer_rank("global_batch_size"):
            raise AccumulationError(f"global_batch_size={batch} with {micro} per device x {world_size} processes needs "
                                    f"gradient_accumulation_steps={steps}, but {steps_key}={given}; both set in "
                                    f"{batch_source}: set only one of them")
        config.notes.append(f"global_batch_size={batch} ({batch_source}) replaces {steps_key}={given} "
                            f"({steps_source}): {steps} accumulation steps")
    t["gradient_accumulation_steps"] = steps


def check_accumulation_section(section: AccumulationSettings, config: RecipeConfig) -> None:
    """What the section needs of the rest of the run: the engine, DeepSpeed, the resolved batch arithmetic, the batch
    keys a token budget replaces (run after the batch arithmetic is resolved). Each value on its own was checked
    when the section was built (:meth:`hf_accum.settings.AccumulationSettings.validate`)."""
    t = config.training
    if section.loss_kind not in (None, "causal_lm"):
        raise AccumulationError(f"accumulation.loss_kind={section.loss_kind!r}: the recipe trains causal LMs; "
                                "allowed: null (inferred), causal_lm")
    if config.engine != "loop":
        refuse_planned_windows("accumulation.", section.rampup_batch_size, section.tokens_per_update)
    micro, world = t.per_device_train_batch_size, int(os.environ.get("WORLD_SIZE", "1"))
    if section.auto_ramp:  # before the noise scale's own refusals: the ramp turned it on
        _check_auto_ramp(section, config, micro, world)
    elif isinstance(section.rampup_batch_size, list):  # the nearest valid values when it does not fit the batch
        RampUp.from_list(section.rampup_batch_size, micro * t.gradient_accumulation_steps * world, micro, world,
                         key="accumulation.rampup_batch_size")
    if section.noise_scale and t.get("deepspeed"):
        raise AccumulationError("accumulation.noise_scale=true is not available with training.deepspeed (the engine "
                                "keeps the micro-batch gradients); allowed: false, or drop training.deepspeed")
    if section.noise_scale and t.gradient_accumulation_steps == 1 and not section.auto_ramp:
        config.notes.append("accumulation.noise_scale=true with one micro-batch per update and process: only "
                            "updates spanning several micro-batches are measured")
    if section.tokens_per_update is not None:
        _yield_batch_keys(config)


def _check_auto_ramp(section: AccumulationSettings, config: RecipeConfig, micro: int, world: int) -> None:
    """``rampup_batch_size: auto``: the start batch on the resolved arithmetic; what its schedule over samples and
    its measurement exclude."""
    t = config.training
    key = "accumulation.rampup_auto"
    BatchController(AutoRampSettings.of(section.rampup_auto, key), micro * world, t.gradient_accumulation_steps, key)
    where = "accumulation.rampup_batch_size=auto"
    if t.get("deepspeed"):
        raise AccumulationError(f"{where} is not available with training.deepspeed (the noise scale it steers by "
                                "cannot be measured inside the engine); allowed: a list, or drop training.deepspeed")
    if (t.get("max_steps") or -1) > 0:
        raise AccumulationError(f"{where} with training.max_steps={t['max_steps']}: the run's length is its data "
                                "(training.num_train_epochs); allowed: -1")
    if (t.get("warmup_steps") or 0) >= 1:
        raise AccumulationError(f"{where} with training.warmup_steps={t['warmup_steps']}: the LR schedule runs over "
                                "consumed samples; allowed: a fraction below 1 (of the run's samples)")


def _yield_batch_keys(config: RecipeConfig) -> None:
    budget = config.accumulation.tokens_per_update
    for key, value in (("global_batch_size", config.global_batch_size),
                       ("training.gradient_accumulation_steps", config.training.get("gradient_accumulation_steps"))):
        rank = config.layer_rank(key)  # 0: a built-in default, or derived from global_batch_size
        if value is not None and rank > 0 and rank >= config.layer_rank(_BUDGET):
            raise AccumulationError(f"{_BUDGET}={budget} ({config.source(_BUDGET)}) and {key}={value} "
                                    f"({config.source(key)}) both size the update; set only one of them")
    if config.global_batch_size is not None or config.training.gradient_accumulation_steps != 1:
        config.notes.append(f"{_BUDGET}={budget} replaces global_batch_size / gradient_accumulation_steps of a "
                            "lower layer: each update holds that many targets")
    config.global_batch_size = None
    config.training["gradient_accumulation_steps"] = 1
