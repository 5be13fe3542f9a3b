"""The recipe's ``dpo:`` section (:class:`~hf_accum.recipe.config.sections.DPOSection`, its keys, declared in the
config kit), checked before anything loads (:func:`check_dpo_section`, run by :mod:`hf_accum.recipe.checks`): allowed
values, and what ``objective: dpo`` cannot run with (one line naming the key, exit 2). The ``objective`` names are
the recipe's objective table, checked by :func:`hf_accum.recipe.config.prepared`. The DPO training itself is
:mod:`hf_accum.recipe.preference`."""

from __future__ import annotations

from hf_accum.errors import InputError
from hf_accum.losses.preference import PAIR_LOSS_TYPES
from hf_accum.recipe.config.schema import RecipeConfig
from hf_accum.recipe.config.sections import DPOSection
from hf_accum.recipe.data.formats import FORMATS, PREFERENCE_FORMATS


class PreferenceConfigError(InputError):
    """A value of ``objective`` / the ``dpo`` section, or a setting DPO cannot run with (exit 2)."""


# ----------------------------------------------------------------------------------------------
# The dpo section's check
# ----------------------------------------------------------------------------------------------


def check_dpo_section(dpo: DPOSection, config: RecipeConfig) -> None:
    """The ``dpo`` section: allowed values, and what DPO cannot run with (one line, exit 2)."""
    if dpo.loss_type not in PAIR_LOSS_TYPES:
        whole = " (it depends on the whole batch: no accumulation reproduces it)" if "aot" in dpo.loss_type else ""
        raise PreferenceConfigError(f"dpo.loss_type={dpo.loss_type!r}{whole}; allowed: {', '.join(PAIR_LOSS_TYPES)} "
                                    "(an SFT term on the chosen answers: dpo.sft_weight)")
    if not dpo.beta > 0:
        raise PreferenceConfigError(f"dpo.beta={dpo.beta} must be > 0")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise PreferenceConfigError(
            f"dpo.label_smoothing={dpo.label_smoothing} must be >= 0 and < 0.5 (a preference flip rate)")
    if dpo.sft_weight < 0:
        raise PreferenceConfigError(f"dpo.sft_weight={dpo.sft_weight} must be >= 0 (0: no SFT term)")
    if config.objective == "sft":
        _check_sft(dpo, config)
    elif config.objective == "dpo":
        _check_dpo_run(config)


def _check_sft(dpo: DPOSection, config: RecipeConfig) -> None:
    if config.data.format in PREFERENCE_FORMATS:
        raise PreferenceConfigError(f"data.format={config.data.format} is preference data: it needs objective=dpo")
    if dpo != type(dpo)():  # any dpo key set
        config.notes.append("the dpo section is not used with objective=sft (set objective=dpo to train DPO)")


# What objective=dpo cannot run with yet: (is it set?, "key=value (why)").
def _dpo_refusals(config: RecipeConfig) -> list[tuple[bool, str]]:
    t, acc = config.training, config.accumulation
    return [
        (config.data.format in FORMATS, f"data.format={config.data.format} (allowed with objective=dpo: auto, "
                                         f"{', '.join(PREFERENCE_FORMATS)})"),
        (config.data.packing, "data.packing=true (pairs are padded: chosen rows, then rejected rows)"),
        (acc.normalization != "token", f"accumulation.normalization={acc.normalization} (DPO's unit is the pair: "
                                       "leave it token)"),
        (acc.tokens_per_update is not None, "accumulation.tokens_per_update (token-budget windows count tokens, "
                                            "DPO's unit is the pair)"),
        (acc.rampup_batch_size is not None, "accumulation.rampup_batch_size (not built for pairs yet)"),
        (acc.noise_scale, "accumulation.noise_scale=true (not built for pairs yet)"),
        (bool(t.get("deepspeed")), "training.deepspeed (DPO in the recipe runs on one process or DDP; not tested "
                                   "under DeepSpeed yet)"),
        (bool(t.get("fsdp")), "training.fsdp (DPO in the recipe runs on one process or DDP; not tested under FSDP "
                              "yet)"),
    ]


def _check_dpo_run(config: RecipeConfig) -> None:
    for refused, what in _dpo_refusals(config):
        if refused:
            raise PreferenceConfigError(f"objective=dpo cannot run with {what}")
