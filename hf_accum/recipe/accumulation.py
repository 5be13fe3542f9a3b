"""The ``accumulation:`` section's meaning: what each key asks of the two engines, checked before any work.

``noise_scale: true`` -> ``LoopConfig(noise_scale=True)`` (loop engine) or ``AccumTrainer(noise_scale=True)``
(trainer engine): both measure the first micro-batch of each window against the update
(:mod:`hf_accum.noise_probe`). DeepSpeed keeps the micro-batch gradients inside its engine, so the key is
refused there, and one micro-batch per update measures nothing (said, not refused).
"""

from __future__ import annotations

from typing import Any

from hf_accum.recipe.config.schema import AccumulationSection, ConfigError
from hf_accum.sequence_norm import NORMALIZATIONS


def check_accumulation_section(section: AccumulationSection, config: Any = None) -> None:
    """The section's own check (its ``Section.validator``)."""
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
