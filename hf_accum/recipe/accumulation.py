"""The recipe's ``accumulation:`` section: what each key asks of the engines, checked before anything loads,
and the :class:`~hf_accum.loop.LoopConfig` / ``AccumTrainer`` settings they become.

* ``rampup_batch_size`` and ``tokens_per_update`` (loop engine only): the window changes from update to update
  (:mod:`hf_accum.loop.windows`). With a token budget the update's size is the budget: a ``global_batch_size`` or
  ``training.gradient_accumulation_steps`` from a lower layer (built-in or embedded default) yields to it (a
  note says so, and the Accelerator's K becomes 1); one given in the same layer or above is a conflict.
* ``rampup_batch_size: auto`` (loop engine): the noise-scale controller (:mod:`hf_accum.auto_ramp`), its settings
  in ``rampup_auto``; checked here against the batch arithmetic, ``training.max_steps`` / ``warmup_steps`` (its
  schedule runs over samples) and DeepSpeed (no noise-scale measurement there).
* ``noise_scale: true`` -> ``LoopConfig(noise_scale=True)`` / ``AccumTrainer(noise_scale=True)``: both measure
  the first micro-batch of each window against the update (:mod:`hf_accum.noise_probe`). DeepSpeed keeps the
  micro-batch gradients inside its engine, so the key is refused there; one micro-batch per update measures
  nothing (said, not refused).
* ``normalization: token | sequence`` (:mod:`hf_accum.sequence_norm`), both engines.
"""

from __future__ import annotations

from typing import Any

from hf_accum.auto_ramp import AutoRampSettings, BatchController, is_auto
from hf_accum.loop.config import LoopConfig
from hf_accum.loop.windows import refuse_planned_windows
from hf_accum.rampup import RampUp
from hf_accum.recipe.config.schema import BUILTIN, COMMAND_LINE, EMBEDDED_SOURCE, ConfigError
from hf_accum.sequence_norm import NORMALIZATIONS

_BUDGET = "accumulation.tokens_per_update"


def check_accumulation_section(section: Any, config: Any) -> None:
    """``Section.validator`` of ``accumulation``: values, the engine, the batch keys a budget replaces."""
    _check_measurement(section, config)  # first: its messages name the accumulation.* key itself
    if config.engine != "loop":
        refuse_planned_windows("accumulation.", section.rampup_batch_size, section.tokens_per_update)
    if is_auto(section.rampup_batch_size):  # first: its messages name the accumulation.* keys
        _check_auto_ramp(section, config)
    LoopConfig(**loop_settings(section))  # the loop's own checks (one line naming the LoopConfig field)
    if section.rampup_batch_size is not None and not is_auto(section.rampup_batch_size):
        _check_ramp(section.rampup_batch_size, config)
    if section.tokens_per_update is not None:
        _yield_batch_keys(config)


def loop_settings(section: Any) -> dict[str, Any]:
    """The ``LoopConfig`` fields the section sets."""
    return {"rampup_batch_size": section.rampup_batch_size, "tokens_per_update": section.tokens_per_update,
            "noise_scale": section.noise_scale, "normalization": section.normalization,
            "rampup_auto": section.rampup_auto}


def _check_ramp(values: Any, config: Any) -> None:
    """Against the resolved batch arithmetic (the nearest valid values when it does not fit)."""
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"accumulation.rampup_batch_size={values!r}; allowed: [start, increment, samples], auto, "
                          "null")
    from hf_accum.recipe.config.validation import world_size_from_env

    t = config.training
    micro, steps, world = t.get("per_device_train_batch_size", 8), t.get("gradient_accumulation_steps", 1), \
        world_size_from_env()
    RampUp.from_list(list(values), micro * steps * world, micro, world, key="accumulation.rampup_batch_size")


def _check_auto_ramp(section: Any, config: Any) -> None:
    """``rampup_batch_size: auto``: the start batch on the resolved arithmetic; what its schedule over samples and
    its measurement exclude."""
    from hf_accum.recipe.config.validation import world_size_from_env

    t = config.training
    micro, steps, world = t.get("per_device_train_batch_size", 8), t.get("gradient_accumulation_steps", 1), \
        world_size_from_env()
    key = "accumulation.rampup_auto"
    BatchController(AutoRampSettings.of(section.rampup_auto, key), micro * world, steps, key)
    where = "accumulation.rampup_batch_size=auto"
    if t.get("deepspeed"):
        raise ConfigError(f"{where} is not available with training.deepspeed (the noise scale it steers by cannot "
                          "be measured inside the engine); allowed: a list, or drop training.deepspeed")
    if (t.get("max_steps") or -1) > 0:
        raise ConfigError(f"{where} with training.max_steps={t['max_steps']}: the run's length is its data "
                          "(training.num_train_epochs); allowed: -1")
    if (t.get("warmup_steps") or 0) >= 1:
        raise ConfigError(f"{where} with training.warmup_steps={t['warmup_steps']}: the LR schedule runs over consumed "
                          "samples; allowed: a fraction below 1 (of the run's samples)")


def _rank(source: str) -> int:
    return {BUILTIN: 0, EMBEDDED_SOURCE: 1, COMMAND_LINE: 3}.get(source, 2)


def _yield_batch_keys(config: Any) -> None:
    budget_rank = _rank(config.source(_BUDGET))
    batch = config.global_batch_size
    for key, value in (("global_batch_size", batch),
                       ("training.gradient_accumulation_steps", config.training.get("gradient_accumulation_steps"))):
        source = config.source(key)
        if value is None or source == BUILTIN:  # unset, or derived from global_batch_size
            continue
        if _rank(source) >= budget_rank:
            raise ConfigError(
                f"{_BUDGET}={config.accumulation.tokens_per_update} ({config.source(_BUDGET)}) and {key}={value} "
                f"({source}) both size the update; set only one of them"
            )
    if batch is not None or config.training.get("gradient_accumulation_steps", 1) != 1:
        config.notes.append(
            f"{_BUDGET}={config.accumulation.tokens_per_update} replaces global_batch_size / "
            "gradient_accumulation_steps of a lower layer: each update holds that many targets"
        )
    config.global_batch_size = None
    config.training["gradient_accumulation_steps"] = 1


def _check_measurement(section: Any, config: Any = None) -> None:
    """``noise_scale`` and ``normalization``: their values, and what DeepSpeed cannot measure."""
    if not isinstance(section.noise_scale, bool):
        raise ConfigError(f"accumulation.noise_scale={section.noise_scale!r}; allowed: true, false")
    if section.normalization not in NORMALIZATIONS:
        raise ConfigError(f"accumulation.normalization={section.normalization!r}; allowed: "
                          f"{', '.join(NORMALIZATIONS)}")
    training = getattr(config, "training", None) or {}
    if section.noise_scale and training.get("deepspeed"):
        raise ConfigError("accumulation.noise_scale=true is not available with training.deepspeed (the engine "
                          "keeps the micro-batch gradients); allowed: false, or drop training.deepspeed")
    if section.noise_scale and training.get("gradient_accumulation_steps") == 1 and config is not None:
        config.notes.append("accumulation.noise_scale=true with one micro-batch per update and process: only "
                            "updates spanning several micro-batches are measured")


def normalization(config: Any) -> str:
    """What the engines pass on: ``LoopConfig(normalization=...)`` / ``AccumTrainer(normalization=...)``."""
    section = getattr(config, "accumulation", None)
    return section.normalization if section is not None else "token"


def noise_scale_enabled(config: Any) -> bool:
    """What the engines pass on: ``LoopConfig(noise_scale=...)`` / ``AccumTrainer(noise_scale=...)``."""
    section = getattr(config, "accumulation", None)
    return bool(section is not None and section.noise_scale)
