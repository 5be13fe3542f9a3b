"""The recipe's ``grpo:`` section (:class:`~hf_accum.recipe.config.grpo.GRPOSection`, its keys, declared in the
config kit), checked before anything loads (:func:`check_grpo_section`, run by :mod:`hf_accum.recipe.checks`): allowed
values, the rewards resolved (a user's function imported and its signature checked), the generation batch
arithmetic, and what ``objective: grpo`` cannot run with (one line naming the key, exit 2). The GRPO training itself
is :mod:`hf_accum.recipe.grpo`."""

from __future__ import annotations

import os

from hf_accum.errors import InputError
from hf_accum.recipe.config.grpo import GRPOSection
from hf_accum.recipe.config.schema import RecipeConfig
from hf_accum.recipe.data.formats import FORMATS
from hf_accum.recipe.rewards import check_pattern, resolve_rewards
from hf_accum.settings import AccumulationSettings

# TRL 1.16's loss types, each exact over every update in hf_accum.trainer.grpo (MODE_UNITS; a test compares them).
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
SAMPLING_LEVELS = ("token", "sequence")
GRPO_FORMATS = tuple(name for name in FORMATS if name != "text")


class GRPOConfigError(InputError):
    """A value of the ``grpo`` section, or a setting GRPO cannot run with (exit 2)."""


def check_grpo_section(grpo: GRPOSection, config: RecipeConfig) -> None:
    """The ``grpo`` section: allowed values; with ``objective: grpo`` also the rewards (imported), the batch and what
    GRPO cannot run with."""
    _check_values(grpo)
    if config.objective != "grpo":
        if grpo != GRPOSection():
            config.notes.append("the grpo section is not used with objective="
                                f"{config.objective} (set objective=grpo to train GRPO)")
        return
    for refused, what in _grpo_refusals(config):
        if refused:
            raise GRPOConfigError(f"objective=grpo cannot run with {what}")
    _check_generation_batch(grpo, config)
    _check_warm_start_batch(grpo, config)
    resolve_rewards(grpo.reward_funcs, grpo.format_pattern)  # imported now: a bad path fails before any load


def _check_values(grpo: GRPOSection) -> None:
    choices = {"loss_type": LOSS_TYPES, "scale_rewards": SCALE_REWARDS, "importance_sampling_level": SAMPLING_LEVELS}
    for key, allowed in choices.items():
        if getattr(grpo, key) not in allowed:
            raise GRPOConfigError(f"grpo.{key}={getattr(grpo, key)!r}; allowed: {', '.join(allowed)}")
    minimums = {"num_generations": 2, "max_completion_length": 1, "num_iterations": 1, "warm_start_steps": 0,
                "top_k": 0}
    for key, minimum in minimums.items():
        if getattr(grpo, key) < minimum:
            raise GRPOConfigError(f"grpo.{key}={getattr(grpo, key)} must be >= {minimum}")
    positive = {"temperature": grpo.temperature, "epsilon": grpo.epsilon, "top_p": grpo.top_p}
    for key, value in positive.items():
        if not value > 0:
            raise GRPOConfigError(f"grpo.{key}={value} must be > 0")
    if grpo.beta < 0 or grpo.entropy_coef < 0:
        key = "beta" if grpo.beta < 0 else "entropy_coef"
        raise GRPOConfigError(f"grpo.{key}={getattr(grpo, key)} must be >= 0 (0: off)")
    if grpo.steps_per_generation is not None and grpo.steps_per_generation < 1:
        raise GRPOConfigError(f"grpo.steps_per_generation={grpo.steps_per_generation} must be >= 1 (null: "
                              "training.gradient_accumulation_steps)")
    if grpo.reward_weights is not None and len(grpo.reward_weights) != len(grpo.reward_funcs):
        raise GRPOConfigError(f"grpo.reward_weights={grpo.reward_weights} has {len(grpo.reward_weights)} weights for "
                              f"{len(grpo.reward_funcs)} grpo.reward_funcs; give one per reward (or null: all 1)")
    check_pattern(grpo.format_pattern)


# What objective=grpo cannot run with: (is it set?, "key=value (why)").
def _grpo_refusals(config: RecipeConfig) -> list[tuple[bool, str]]:
    t, acc, grpo = config.training, config.accumulation, config.grpo
    return [
        (config.engine != "trainer", f"engine={config.engine} (GRPO generates its completions with TRL "
                                     "inside hf_accum.AccumGRPOTrainer; the loop engine has no generation: set "
                                     "engine=trainer)"),
        (config.data.format not in ("auto", *GRPO_FORMATS),
         f"data.format={config.data.format} (allowed with objective=grpo: auto, {', '.join(GRPO_FORMATS)}: prompts "
         "with their reference answers)"),
        (config.data.packing, "data.packing=true (GRPO trains on generated completions, not packed rows)"),
        (bool(unapplied := _unapplied_accumulation(acc)),
         f"{', '.join(unapplied)} (AccumGRPOTrainer forms GRPO's updates from grpo.loss_type and TRL's settings; of "
         "the accumulation section it takes fused_loss only; allowed: the defaults)"),
        (grpo.beta > 0 and config.model.adapter is not None,
         f"grpo.beta={grpo.beta} with model.adapter (the KL reference would be the base model, not the starting "
         "adapter: not built yet; allowed: grpo.beta=0)"),
        (bool(t.get("deepspeed")), "training.deepspeed (GRPO in the recipe runs on one process or DDP; not tested "
                                   "under DeepSpeed yet)"),
        (bool(t.get("fsdp")), "training.fsdp (GRPO in the recipe runs on one process or DDP; not tested under FSDP "
                              "yet)"),
    ]


def _unapplied_accumulation(settings: AccumulationSettings) -> list[str]:
    """The accumulation settings changed from their defaults that GRPO would not apply (all but ``fused_loss``,
    passed on as ``AccumGRPOTrainer(fused_logprobs=...)``)."""
    default = AccumulationSettings()
    return [f"accumulation.{name}={getattr(settings, name)!r}" for name in sorted(AccumulationSettings.names())
            if name != "fused_loss" and getattr(settings, name) != getattr(default, name)]


def _check_warm_start_batch(grpo: GRPOSection, config: RecipeConfig) -> None:
    """``grpo.warm_start_batch_size`` must be whole micro-batches on every process (its accumulation steps)."""
    if grpo.warm_start_batch_size is None:
        return
    micro = int(config.training.per_device_train_batch_size) * int(os.environ.get("WORLD_SIZE", "1"))
    if grpo.warm_start_batch_size < 1 or grpo.warm_start_batch_size % micro:
        raise GRPOConfigError(
            f"grpo.warm_start_batch_size={grpo.warm_start_batch_size} must be a positive multiple of "
            f"{micro} (training.per_device_train_batch_size x processes), or null (global_batch_size)")


def _check_generation_batch(grpo: GRPOSection, config: RecipeConfig) -> None:
    """TRL samples ``num_generations`` completions per prompt over a generation batch of ``per_device x processes x
    steps_per_generation`` completions: it must hold whole groups."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = int(config.training.per_device_train_batch_size)
    steps = grpo.steps_per_generation or int(config.training.gradient_accumulation_steps)
    batch = per_device * world * steps
    if batch % grpo.num_generations:
        raise GRPOConfigError(
            f"grpo.num_generations={grpo.num_generations} does not divide the generation batch of {batch} completions "
            f"(training.per_device_train_batch_size {per_device} x {world} process{'es' if world > 1 else ''} x "
            f"{steps} {'grpo.steps_per_generation' if grpo.steps_per_generation else 'accumulation steps'}); make "
            "global_batch_size a multiple of num_generations")
